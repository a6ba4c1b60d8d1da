"""Every file melfeed writes at a path a user chose refuses another user's trap, through the real CLI: a
symbolic link planted in a sticky shared directory (the /tmp symlink attack: alice writes /tmp/m.jsonl,
mallory made it a link to ~alice/.bashrc first), a file of theirs planted there, a directory of theirs.
One line naming the flag or key, exit 78, and the victim file unchanged (shared/filetrust.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

from tests.cli_run import REPO, refusal, run_cli
from tests.planted import MALLORY, needs_root, plant_dir, plant_file, plant_link, sticky_dir, victim

pytestmark = needs_root

_BASHRC = "alias ls='ls --color'\n"
_LINK_WHY = "is a symbolic link, which is never followed (another user may have planted it); remove it"


def _metrics_jsonl(path: Path) -> Path:
    from tests.fakes import realistic_run

    path.write_text("".join(json.dumps(line) + "\n" for line in realistic_run(n_lines=20, gpus=False)))
    return path


@pytest.mark.parametrize(
    ("argv", "command", "key"),
    [
        (["consumer", "--cache-dir", "{tmp}", "--metrics-file", "{out}"], "consumer", "consumer.metrics_file"),
        (["consumer", "--cache-dir", "{tmp}", "--summary-json", "{out}"], "consumer", "--summary-json"),
        (["run", "--cache-dir", "{tmp}", "--summary-json", "{out}"], "run", "--summary-json"),
        (["doctor", "--cache-dir", "{tmp}", "-o", "{out}"], "doctor", "--output"),
        (["bench", "--output", "{out}"], "bench", "--output"),
        (["audit", "{tmp}", "-o", "{out}"], "audit", "--output"),
        (["audit", "{tmp}", "{tmp}", "-o", "{out}"], "audit", "--output"),
        (["report", "{metrics}", "-o", "{out}"], "report", "--output"),
    ],
)
def test_a_link_planted_at_an_output_is_refused_and_the_file_it_points_to_is_untouched(
    tmp_path: Path, argv: list[str], command: str, key: str
) -> None:
    bashrc = victim(tmp_path)
    out = plant_link(sticky_dir(tmp_path) / "out", bashrc)
    metrics = _metrics_jsonl(tmp_path / "m.jsonl")
    proc = run_cli(
        *(a.format(tmp=tmp_path, out=out, metrics=metrics) for a in argv), env={"XDG_RUNTIME_DIR": str(tmp_path)}
    )
    assert refusal(proc, command) == f"{key}: refusing to write {out}: {_LINK_WHY}"
    assert bashrc.read_text() == _BASHRC and out.is_symlink()


@pytest.mark.parametrize("flag", ["--metrics-file", "--summary-json"])
def test_a_file_another_user_planted_in_a_sticky_directory_is_refused(tmp_path: Path, flag: str) -> None:
    shared = sticky_dir(tmp_path)
    planted = plant_file(shared / "out.jsonl")  # theirs, 0666: they would read what we append
    proc = run_cli("consumer", "--cache-dir", str(tmp_path), flag, str(planted), env={"XDG_RUNTIME_DIR": str(tmp_path)})
    key = "consumer.metrics_file" if flag == "--metrics-file" else flag
    assert refusal(proc, "consumer") == (
        f"{key}: refusing to write {planted}: belongs to uid {MALLORY}, not to this "
        f"user (uid 0), in {shared}, where other users can create files"
    )
    assert planted.read_text() == "mallory was here\n"


def test_the_metrics_file_and_summary_writers_refuse_a_link_themselves(tmp_path: Path) -> None:
    """Not only the check before the run: the writers (at the first snapshot, at the end) refuse too."""
    from melfeed.consumer.observe.telemetry import open_metrics_file
    from melfeed.consumer.train.loop import TrainSummary
    from melfeed.shared.errors import ConfigError

    bashrc = victim(tmp_path)
    shared = sticky_dir(tmp_path)
    with pytest.raises(ConfigError, match=f"^consumer.metrics_file: refusing to write .*: {re.escape(_LINK_WHY)}"):
        open_metrics_file(str(plant_link(shared / "m.jsonl", bashrc)))
    with pytest.raises(ConfigError, match=f"^--summary-json: refusing to write .*: {re.escape(_LINK_WHY)}"):
        TrainSummary().write(plant_link(shared / "s.json", bashrc))
    assert bashrc.read_text() == _BASHRC


def test_jax_bench_json_refuses_a_planted_link_before_measuring(tmp_path: Path) -> None:
    pytest.importorskip("jax")
    bashrc = victim(tmp_path)
    out = plant_link(sticky_dir(tmp_path) / "jax.json", bashrc)
    proc = subprocess.run(
        [sys.executable, "-m", "melfeed.consumer.clients.jax_bench", "--demo", "--json", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )
    assert proc.returncode == 78, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"jax_bench: --json: refusing to write {out}: {_LINK_WHY}"
    assert bashrc.read_text() == _BASHRC and not (tmp_path / "cache").exists()


def _deploy(target: Path, config: Path) -> subprocess.CompletedProcess[str]:
    return run_cli("deploy", "--user", "root", "--config", str(config), "--target-dir", str(target), "--producers", "1")


def test_deploy_refuses_a_target_another_user_can_write_to_or_swap(tmp_path: Path) -> None:
    config = tmp_path / "melfeed.yaml"
    config.write_text(yaml.safe_dump({"cache_dir": "/srv/cache"}))
    shared = sticky_dir(tmp_path)
    assert refusal(_deploy(shared, config), "deploy") == (
        f"--target-dir: refusing to write in {shared}: is mode 1777: other users can write to it"
    )
    theirs = plant_dir(shared / "units", 0o755)
    assert refusal(_deploy(theirs, config), "deploy") == (
        f"--target-dir: refusing to write in {theirs}: belongs to uid {MALLORY}, neither this user (0) nor root"
    )
    units = tmp_path / "units"
    units.mkdir(mode=0o755)
    link = plant_link(shared / "systemd", units)
    assert refusal(_deploy(link, config), "deploy") == (
        f"--target-dir: refusing to write in {link}: it is reached through {link}, a symbolic link of uid {MALLORY}, "
        "who could point it elsewhere"
    )
    assert list(units.iterdir()) == [] and list(theirs.iterdir()) == []


def test_deploy_replaces_a_link_at_a_units_name_instead_of_writing_through_it(tmp_path: Path) -> None:
    config = tmp_path / "melfeed.yaml"
    config.write_text(yaml.safe_dump({"cache_dir": "/srv/cache"}))
    units = tmp_path / "units"
    units.mkdir(mode=0o755)
    bashrc = victim(tmp_path)
    (units / "consumer.service").symlink_to(bashrc)  # left there (by whoever could, i.e. root)
    (units / ".consumer.service.tmp").symlink_to(bashrc)  # the temporary name deploy once used
    proc = _deploy(units, config)
    assert proc.returncode == 0, proc.stderr
    unit = units / "consumer.service"
    assert not unit.is_symlink() and "[Service]" in unit.read_text() and os.stat(unit).st_mode & 0o777 == 0o644
    assert bashrc.read_text() == _BASHRC


@pytest.mark.parametrize("command", ["demo-data", "prepare"])
def test_a_cache_directory_another_user_made_is_refused_before_anything_is_written(
    tmp_path: Path, command: str
) -> None:
    theirs = plant_dir(sticky_dir(tmp_path) / "cache", 0o777)
    bashrc = victim(tmp_path)
    (theirs / "mels").mkdir()
    plant_link(theirs / "mels" / "LJ001-0001.npy", bashrc)  # the first file the demo writes
    corpus = tmp_path / "corpus"
    (corpus / "wavs").mkdir(parents=True)
    (corpus / "metadata.csv").write_text("")
    argv = (
        ["demo-data", "--cache-dir", str(theirs), "--utterances", "3"]
        if command == "demo-data"
        else ["prepare", "--ljspeech", str(corpus), "--cache-dir", str(theirs)]
    )
    assert refusal(run_cli(*argv), command) == (
        f"{theirs}: refusing to write the {'demo cache' if command == 'demo-data' else 'cache'}: belongs to uid "
        f"{MALLORY}, neither this user (0) nor root"
    )
    assert bashrc.read_text() == _BASHRC and sorted(p.name for p in theirs.iterdir()) == ["mels"]


def test_keys_demo_data_and_prepare_make_nothing_inside_another_users_directory(tmp_path: Path) -> None:
    """The directory to make is new, its parent is theirs: refused before even an empty directory or a lock."""
    from melfeed.producer.prepare.command import run_prepare
    from melfeed.shared.cache.demo_data import write_demo_cache
    from melfeed.shared.config import PipelineConfig
    from melfeed.shared.errors import CacheError, ConfigError
    from melfeed.shared.wire.curve import generate_keys

    theirs = plant_dir(tmp_path / "alice", 0o755)  # another user's home, readable by all
    why = f"its parent {theirs} belongs to uid {MALLORY}, who could move it"
    with pytest.raises(ConfigError, match=re.escape(f"{theirs / 'k'}: refusing to write the keys: {why}")):
        generate_keys(theirs / "k", ["a"])
    with pytest.raises(CacheError, match=re.escape(f"refusing to write the demo cache: {why}")):
        write_demo_cache(theirs / "d" / "cache", n_utterances=2)
    with pytest.raises(CacheError, match=re.escape(f"refusing to write the cache: {why}")):
        run_prepare(tmp_path / "no-corpus", theirs / "c", PipelineConfig(), 1, threading.Event(), sys.stderr)
    assert list(theirs.iterdir()) == []
