"""index, verify-cache and manifest loading meet entries that are not regular files (FIFO, /dev/zero, ...).

Each test has a short timeout: a reader that opens a FIFO without ``O_NONBLOCK`` (or reads /dev/zero
to its end) hangs, and the timeout turns that into a failure instead of a stuck run.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from melfeed.shared.cache.demo_data import demo_utterance_id, write_demo_cache
from melfeed.shared.cache.filekind import make_dirs, open_regular, read_json, read_regular, write_atomic
from melfeed.shared.cache.index import build_manifest
from melfeed.shared.cache.manifest import MANIFEST_NAME, load_manifest
from melfeed.shared.cache.npyfile import inspect_npy
from melfeed.shared.cache.verify import verify_cache
from melfeed.shared.errors import CacheError

REPO = Path(__file__).resolve().parents[4]
N = 8
_BOUND_S = 20  # a blocking open or an endless read fails the test instead of hanging


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:
    path.symlink_to("/dev/zero")


def _directory(path: Path) -> None:
    path.mkdir()


def _loop(path: Path) -> None:  # a -> b -> a
    other = path.with_name(path.name + ".other")
    other.symlink_to(path.name)
    path.symlink_to(other.name)


def _dangling(path: Path) -> None:
    path.symlink_to(path.with_name("gone.bin"))


# kind -> (make an entry at a path that does not exist yet, the reason every reader gives)
KINDS: dict[str, tuple[Callable[[Path], None], str]] = {
    "fifo": (_fifo, "not a regular file (fifo)"),
    "dev_zero": (_dev_zero, "not a regular file (character device)"),
    "directory": (_directory, "not a regular file (directory)"),
    "loop": (_loop, "not a regular file (symlink loop)"),
    "dangling": (_dangling, "not a regular file (dangling symlink to "),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("filekind") / "cache"
    write_demo_cache(path, n_utterances=N)  # indexed: manifest.json written
    return path


@pytest.fixture
def cache(pristine: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "cache", symlinks=True))


def _replace(cache: Path, sub: str, i: int, kind: str) -> Path:
    path = cache / sub / f"{demo_utterance_id(i)}.npy"
    path.unlink()
    KINDS[kind][0](path)
    return path


@pytest.mark.timeout(_BOUND_S)
@pytest.mark.parametrize("kind", list(KINDS))
def test_open_regular_refuses_every_other_kind_without_blocking(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "x.npy"
    KINDS[kind][0](path)
    for opener in (open_regular, read_regular, inspect_npy):
        with pytest.raises(CacheError) as info:
            opener(path)
        assert info.value.path == str(path) and info.value.reason.startswith(KINDS[kind][1])
        assert "\n" not in str(info.value)


def test_a_missing_file_is_still_missing(tmp_path: Path) -> None:
    with pytest.raises(CacheError, match=r"x\.npy: missing$"):
        open_regular(tmp_path / "x.npy")


@pytest.mark.timeout(_BOUND_S)
@pytest.mark.parametrize("kind", list(KINDS))
def test_index_reports_the_entry_with_its_reason(cache: Path, kind: str) -> None:
    path = _replace(cache, "mels", 4, kind)
    manifest, problems = build_manifest(cache, 80)
    assert [(p.path, p.reason[: len(KINDS[kind][1])]) for p in problems] == [(str(path), KINDS[kind][1])]
    assert len(manifest.utterances) == N - 1


@pytest.mark.timeout(_BOUND_S)
@pytest.mark.parametrize("with_manifest", [True, False])
def test_verify_reports_every_kind_once_sorted_by_path(cache: Path, with_manifest: bool) -> None:
    if not with_manifest:
        (cache / MANIFEST_NAME).unlink()
    paths = {kind: _replace(cache, "mels" if i % 2 else "tokens", i, kind) for i, kind in enumerate(KINDS)}
    report = verify_cache(cache, 80)
    assert report.has_manifest is with_manifest
    want = sorted((str(p), KINDS[k][1]) for k, p in paths.items())
    assert len(report.bad) == len(want)
    assert [(p.path, p.reason[: len(r)]) for p, (_, r) in zip(report.bad, want)] == want
    assert report.warnings == ()


@pytest.mark.timeout(_BOUND_S)
def test_a_fifo_named_manifest_json_is_refused_not_read(cache: Path) -> None:
    (cache / MANIFEST_NAME).unlink()
    os.mkfifo(cache / MANIFEST_NAME)
    with pytest.raises(CacheError, match=r"manifest\.json: not a regular file \(fifo\)$"):
        load_manifest(cache)
    report = verify_cache(cache, 80)  # reported, then every file checked by its header
    assert [(p.path, p.reason) for p in report.bad] == [(str(cache / MANIFEST_NAME), "not a regular file (fifo)")]


def _cli(command: str, cache: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "melfeed", command, "--cache-dir", str(cache)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=_BOUND_S,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "MELFEED_PROGRESS_S": ""},
    )


@pytest.mark.timeout(3 * _BOUND_S)
def test_cli_index_and_verify_print_one_line_per_entry_and_exit_1(cache: Path) -> None:
    paths = {kind: _replace(cache, "mels", i, kind) for i, kind in enumerate(KINDS)}
    want = [f"bad: {paths[k]}: {KINDS[k][1]}" for k in sorted(KINDS, key=lambda k: str(paths[k]))]
    verify = _cli("verify-cache", cache)
    assert verify.returncode == 1, verify.stderr
    lines = verify.stdout.splitlines()
    assert [line[: len(w)] for line, w in zip(lines, want)] == want and len(lines) == len(KINDS) + 1
    assert lines[-1] == f"verified {N} utterances ({2 * N} files): {len(KINDS)} bad"
    (cache / MANIFEST_NAME).unlink()
    index = _cli("index", cache)
    assert index.returncode == 1 and "Traceback" not in index.stderr
    bad = [line for line in index.stderr.splitlines() if line.startswith("bad: ")]
    assert [line[: len(w)] for line, w in zip(bad, want)] == want and len(bad) == len(KINDS)
    assert not (cache / MANIFEST_NAME).exists()


def test_read_json_turns_nesting_past_the_recursion_limit_into_a_value_error(tmp_path: Path) -> None:
    (tmp_path / "deep.json").write_text('{"a": ' * 100_000 + "1" + "}" * 100_000)
    with pytest.raises(ValueError, match="^nested too deeply$"):
        read_json(tmp_path / "deep.json")
    (tmp_path / "ok.json").write_text("[[[1]]]")
    assert read_json(tmp_path / "ok.json") == [[[1]]]


def test_write_atomic_names_the_file_and_the_os_reason_and_leaves_no_temp_file(tmp_path: Path) -> None:
    (tmp_path / "x.json").mkdir()
    with pytest.raises(CacheError, match=f"^{tmp_path}/x.json: cannot write \\(Is a directory\\)$"):
        write_atomic(tmp_path, "x.json", b"{}")
    with pytest.raises(CacheError, match="^/proc/melfeed/x.json: cannot write \\(No such file or directory\\)$"):
        write_atomic(Path("/proc/melfeed"), "x.json", b"{}")
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]
    assert write_atomic(tmp_path, "y.json", b"{}").read_bytes() == b"{}"


def test_make_dirs_refuses_a_file_in_the_way_and_an_impossible_path_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(CacheError, match=f"^{tmp_path}/f: not a directory$"):
        make_dirs(tmp_path / "f")
    with pytest.raises(CacheError, match=f"^{tmp_path}/f/a/b: cannot create the directory .*Not a directory"):
        make_dirs(tmp_path / "f" / "a" / "b")
    with pytest.raises(
        CacheError, match="^/proc/melfeed: cannot create the directory \\(No such file or directory\\)$"
    ):
        make_dirs(Path("/proc/melfeed"))
    make_dirs(tmp_path / "a" / "b")
    make_dirs(tmp_path / "a" / "b")  # exists: fine
    assert (tmp_path / "a" / "b").is_dir()


def test_write_atomic_files_are_readable_by_the_users_who_train_whatever_the_umask(tmp_path: Path) -> None:
    """manifest.json indexed by root or alice is read by the units' melfeed user: mkstemp's 0600 refused it."""
    old = os.umask(0o077)
    try:
        written = write_atomic(tmp_path, "manifest.json", b"{}")
        again = write_atomic(tmp_path, "manifest.json", b"[]")
    finally:
        os.umask(old)
    assert written == again and stat.S_IMODE(os.stat(written).st_mode) == 0o644
