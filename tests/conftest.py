"""Shared fixtures: small demo caches, private ipc endpoints, producer groups that must exit."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import yaml

from melfeed.shared.service.stop_ladder import Ladder, stop_process
from tests.lanes import (
    deselects_whole_file,
    imports_process_tools,
    imports_tensorflow_on_import,
    unmarked_tensorflow_files,
)

REPO = Path(__file__).resolve().parent.parent
_GROUP_LADDER = Ladder(60.0, 60.0)  # only a real hang gets near it (tests/procs.py: WAIT_S)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


_INTEGRATION = REPO / "tests" / "integration"
_PROCESS_FIXTURES = {"producers", "durations_cache"}  # both start `melfeed` children


def _known_marks(path: Path) -> set[str]:
    """Marks every test of the file at ``path`` carries, as far as the source tells before importing it."""
    marks = {"proc"} if path.is_relative_to(_INTEGRATION) or imports_process_tools(path) else set()
    return marks | ({"tf"} if imports_tensorflow_on_import(path) else set())


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A lane's ``-m`` expression that deselects a whole file also skips importing it: the fast lane would
    otherwise pay TensorFlow's import for tests it never runs (a unit file importing TensorFlow carries ``tf``,
    ``pytest_collection_modifyitems`` checks)."""
    markexpr = config.getoption("markexpr")
    if not markexpr or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    return True if deselects_whole_file(markexpr, _known_marks(collection_path)) else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks ``proc`` every integration test and each unit test that starts processes; refuses a unit test file
    that imports TensorFlow without the ``tf`` marker, which would put TensorFlow into the fast lane
    (tests/lanes.py)."""
    unmarked = unmarked_tensorflow_files(items, REPO / "tests" / "unit")
    if unmarked:
        raise pytest.UsageError(
            "\n".join(
                f"{path.relative_to(REPO)}: imports TensorFlow without pytestmark = pytest.mark.tf" for path in unmarked
            )
        )
    for item in items:
        if (
            item.path.is_relative_to(_INTEGRATION)
            or imports_process_tools(item.path)
            or _PROCESS_FIXTURES & set(getattr(item, "fixturenames", ()))
        ):
            item.add_marker(pytest.mark.proc)


@pytest.fixture(autouse=True)
def _tensorflow_only_under_tf_marker(request: pytest.FixtureRequest) -> Iterator[None]:
    """A fast-lane test (neither ``tf`` nor ``proc``) that loads TensorFlow, by a lazy import the source scan
    cannot see, fails: it would slow the lane. Seen only where no earlier test of this process loaded it."""
    was_loaded = "tensorflow" in sys.modules
    yield
    in_fast_lane = not any(request.node.get_closest_marker(name) for name in ("tf", "proc"))
    if in_fast_lane and not was_loaded and "tensorflow" in sys.modules:
        pytest.fail(f"{request.node.nodeid} imports TensorFlow without the tf marker", pytrace=False)


@pytest.fixture(autouse=True)
def _reap_started_processes() -> Iterator[None]:
    """A test that fails between starting a consumer and stopping it must not leave it running."""
    yield
    from tests import procs

    procs.reap_started()


@pytest.fixture(autouse=True)
def _restore_root_logging() -> Iterator[None]:
    """A test that runs a command's main in this process (``setup_logging``) replaces the root logger's level and
    handlers: a later test in the same worker would then miss WARNING records (a root left at ERROR) or log to a
    stream pytest has closed. Each test starts from the root logger the one before found."""
    root = logging.getLogger()
    level, handlers = root.level, root.handlers[:]
    yield
    root.setLevel(level)
    root.handlers[:] = handlers


@pytest.fixture
def tmp_path() -> Iterator[Path]:
    """A short private directory per test (``/tmp/mf-XXXXXXXX``) in place of pytest's own, whose path grows
    with its run counter: tests use it as XDG_RUNTIME_DIR (tests/procs.py), and the unix socket paths under
    it (``melfeed/melfeed-rank1.control.sock``) must stay below the 107 bytes a socket path may have
    however many runs the machine has seen. Removed after the test's processes are reaped."""
    path = Path(tempfile.mkdtemp(prefix="mf-", dir="/tmp"))
    yield path
    from tests import procs

    procs.reap_started()
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from melfeed.shared.cache.demo_data import write_demo_cache

    path = tmp_path_factory.mktemp("demo") / "cache"
    write_demo_cache(path, n_utterances=200)
    return path


def token_durations(frames: int, tokens: int) -> npt.NDArray[np.int32]:
    """int32 [tokens], summing to ``frames``: how many frames each token shows for, as the demo data draws them
    (frame t shows token ``t * tokens // frames``, shared/cache/demo_data.py)."""
    starts = -(-np.arange(tokens + 1) * frames // tokens)  # first frame of each token: ceil(i * T / L)
    return np.diff(starts).astype(np.int32)


@pytest.fixture(scope="session")
def durations_cache(demo_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo cache's files (hard links) with two extras adopted by ``melfeed index --extra``, as a user adopts
    them: ``durations`` (token, int32, per ``token_durations``: a FastSpeech-style aligner's output) and
    ``energy`` (frame, float32: the mean log-mel of each frame, as ``--demo`` writes it)."""
    from melfeed.shared.cache.manifest import load_manifest

    base = tmp_path_factory.mktemp("durations")
    root = base / "cache"

    def link_npy(src: str, dst: str) -> None:  # the manifest is copied: index rewrites it
        os.link(src, dst) if src.endswith(".npy") else shutil.copy2(src, dst)

    shutil.copytree(demo_cache, root, ignore=shutil.ignore_patterns("*.pack", "demo.json"), copy_function=link_npy)
    for name in ("durations", "energy"):
        (base / name).mkdir()
    for u in load_manifest(root, 80).utterances:
        np.save(base / "durations" / f"{u.id}.npy", token_durations(u.frames, u.tokens))
        np.save(base / "energy" / f"{u.id}.npy", np.load(root / "mels" / f"{u.id}.npy").mean(axis=1))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "melfeed",
            "index",
            "--cache-dir",
            str(root),
            "--extra",
            f"durations:token={base / 'durations'}",
            "--extra",
            f"energy:frame={base / 'energy'}",
        ],
        check=True,
        cwd=REPO,
        capture_output=True,
        timeout=120,
    )
    return root


@pytest.fixture(params=["shm", "zmq"])
def transport_mode(request: pytest.FixtureRequest) -> str:
    """``transport.mode`` for tests that must pass on both same-host data paths."""
    return str(request.param)


@pytest.fixture()
def endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/melfeed.sock"


class ProducerGroup:
    """``melfeed producer`` as a real child process; always reaped by the fixture."""

    def __init__(self, tmp_path: Path) -> None:
        self._tmp = tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, cache: Path, endpoint: str, count: int, **extra: object) -> subprocess.Popen[bytes]:
        transport = {"endpoint": endpoint, "heartbeat_interval_s": 0.2, **extra.pop("transport", {})}  # type: ignore[dict-item]
        cfg: dict[str, object] = {"cache_dir": str(cache), "transport": transport}
        cfg.update(extra)
        path = self._tmp / f"producers-{len(self.procs)}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        proc = subprocess.Popen(
            [sys.executable, "-m", "melfeed", "producer", "--config", str(path), "--producers", str(count)],
            cwd=REPO,
            env={**os.environ, "XDG_RUNTIME_DIR": str(self._tmp)},
        )
        self.procs.append(proc)
        return proc

    def stop_all(self) -> list[int]:
        """The stop ladder on each group (SIGTERM, bounded wait, SIGKILL); their exit codes."""
        codes = [stop_process(p, "producer group", _GROUP_LADDER) for p in self.procs]
        return [-signal.SIGKILL if code is None else code for code in codes]


@pytest.fixture()
def producers(tmp_path: Path) -> Iterator[ProducerGroup]:
    group = ProducerGroup(tmp_path)
    yield group
    group.stop_all()


@pytest.fixture()
def umask_000() -> Iterator[None]:
    """The umask a careless shell or test runner may have; restored whatever the test does."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)
