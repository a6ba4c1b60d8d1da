"""The audit over a job's ranks (consumer/resume/job_audit.py) and the rank in a state directory's identity."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from melfeed.consumer.flow.shards import plan_for_rank
from melfeed.consumer.resume.job_audit import audit_job, main_audit, union_counts
from melfeed.consumer.resume.state import RunState
from melfeed.shared.cache.manifest import load_manifest
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import ConfigError, StateError
from melfeed.shared.wire.buckets import build_buckets

_STEPS = 9
REPO = Path(__file__).resolve().parents[4]


def _cfg(cache: Path, state_dir: Path, seed: int = 3):  # type: ignore[no-untyped-def]
    return config_from_mapping(
        {"cache_dir": str(cache), "seed": seed, "buckets": {"batch_size": 8}, "consumer": {"state_dir": str(state_dir)}}
    )


def _rank_dir(
    cache: Path,
    root: Path,
    rank: int,
    world: int,
    steps: range | list[int],
    samples_of: int | None = None,
    name: str | None = None,
) -> str:
    """A state dir of ``rank`` whose log applied ``steps`` (samples from rank ``samples_of``'s share)."""
    state_dir = root / (name or f"rank{rank}")
    cfg = _cfg(cache, state_dir)
    manifest = load_manifest(str(cache), cfg.n_mels)
    plan = plan_for_rank(
        build_buckets(manifest.frames, manifest.token_counts, cfg.n_mels, cfg.buckets),
        manifest.fingerprint,
        cfg.seed,
        rank if samples_of is None else samples_of,
        world,
    )
    state = RunState.open(cfg, manifest.fingerprint, rank=rank, world=world)
    assert state is not None
    for step in steps:
        state.record(step, plan.batch(step).sample_ids, 1)
    state.close()
    return str(state_dir)


def test_union_counts_lost_and_duplicated_plan_wide_ids_by_hand() -> None:
    assert union_counts(2, [(0, [0, 1, 2]), (1, [0, 1, 2])], 3) == (0, 0, [])
    # rank 1 stopped after step 0: plan-wide ids 3 and 5 lost; rank 0 listed twice: 3 repeats
    assert union_counts(2, [(0, [0, 1, 2]), (1, [0]), (0, [0, 1, 2])], 3) == (2, 3, [3, 5])


def test_two_ranks_that_applied_their_shares_are_exact_and_the_json_has_each_rank(
    demo_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dirs = [_rank_dir(demo_cache, tmp_path, r, 2, range(_STEPS)) for r in (0, 1)]
    job = audit_job(dirs)
    assert job.ok and (job.expected, job.applied, job.lost, job.duplicated) == (2 * _STEPS, 2 * _STEPS, 0, 0)
    assert [r.content_checked and r.ok and (r.rank, r.world) == (i, 2) for i, (_, r) in enumerate(job.ranks)] == [
        True,
        True,
    ]
    out_json = tmp_path / "audit.json"
    assert main_audit(argparse.Namespace(state_dir=dirs, json=False, output=str(out_json))) == 0
    doc = json.loads(out_json.read_text())
    assert doc["ok"] and doc["world"] == 2 and [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert doc["total"]["expected"] == 2 * _STEPS and doc["total"]["lost"] == 0
    out = capsys.readouterr().out
    assert "(rank 1 of 2: its share, ids are its steps)" in out and "total: lost 0 | duplicated 0" in out


def test_a_short_rank_a_wrong_share_a_missing_rank_and_a_rank_twice_are_each_found(
    demo_cache: Path, tmp_path: Path
) -> None:
    full0 = _rank_dir(demo_cache, tmp_path, 0, 2, range(_STEPS))
    short1 = _rank_dir(demo_cache, tmp_path, 1, 2, range(_STEPS - 2), name="short1")
    job = audit_job([full0, short1])
    assert job.ranks[1][1].ok and (job.lost, job.ok) == (2, False)  # rank 1 alone looks fine; the job does not
    wrong1 = _rank_dir(demo_cache, tmp_path, 1, 2, range(_STEPS), samples_of=0, name="wrong1")
    assert audit_job([full0, wrong1]).wrong_content == _STEPS  # rank 0's samples applied by rank 1
    job = audit_job([full0])
    assert job.missing_ranks == [1] and job.lost == _STEPS
    again0 = _rank_dir(demo_cache, tmp_path, 0, 2, range(_STEPS), name="again0")
    full1 = _rank_dir(demo_cache, tmp_path, 1, 2, range(_STEPS), name="full1")
    assert audit_job([full0, full1, again0]).duplicated == _STEPS
    backwards = _rank_dir(demo_cache, tmp_path, 1, 2, [0, 2, 1, *range(3, _STEPS)], name="backwards1")
    assert audit_job([full0, backwards]).out_of_order == 1


def test_state_dirs_of_another_world_or_plan_are_refused_with_one_line(demo_cache: Path, tmp_path: Path) -> None:
    two = _rank_dir(demo_cache, tmp_path, 0, 2, range(3))
    three = _rank_dir(demo_cache, tmp_path, 1, 3, range(3), name="of3")
    with pytest.raises(StateError, match=f"^{three}: belongs to another job than {two}: world=3, not 2$"):
        audit_job([two, three])


def test_a_state_dir_refuses_another_rank_or_world_and_an_old_run_json_is_rank_0_of_1(
    demo_cache: Path, tmp_path: Path
) -> None:
    state_dir = tmp_path / "s"
    cfg = _cfg(demo_cache, state_dir)
    fingerprint = load_manifest(str(demo_cache), cfg.n_mels).fingerprint
    state = RunState.open(cfg, fingerprint, rank=1, world=2)
    assert state is not None
    state.close()
    for rank, world in ((0, 2), (1, 3), (0, 1)):
        with pytest.raises(StateError, match="this state belongs to rank 1 of 2, this consumer is rank") as err:
            RunState.open(cfg, fingerprint, rank=rank, world=world)
        assert err.value.fatal
    run_json = state_dir / "run.json"
    old = {k: v for k, v in json.loads(run_json.read_text()).items() if k not in ("rank", "world")}
    run_json.write_text(json.dumps(old))  # a run.json without rank and world
    state = RunState.open(cfg, fingerprint)
    assert state is not None
    state.close()
    assert json.loads(run_json.read_text())["world"] == 1
    with pytest.raises(StateError, match="this state belongs to rank 0 of 1"):
        RunState.open(cfg, fingerprint, rank=0, world=2)


def _bare_state_dir(root: Path, name: str = "S") -> Path:
    """The least a state directory holds: a run.json (rank 0 of 1) and an empty audit log."""
    state_dir = root / name
    state_dir.mkdir()
    (state_dir / "run.json").write_text("{}")
    (state_dir / "audit.log").write_bytes(b"")
    return state_dir


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_an_audit_log_that_is_not_a_file_is_one_line_naming_it(tmp_path: Path, kind: str) -> None:
    state_dir = _bare_state_dir(tmp_path)
    log = state_dir / "audit.log"
    log.unlink()
    log.mkdir() if kind == "directory" else os.mkfifo(log)  # a FIFO would block a plain open for ever
    for dirs in ([str(state_dir)], [str(state_dir), str(state_dir)]):
        with pytest.raises(StateError) as info:
            main_audit(argparse.Namespace(state_dir=dirs, json=False, output=None))
        assert str(info.value) == f"{log}: cannot read audit log: not a regular file ({kind})" and info.value.fatal


def test_a_run_json_nested_too_deeply_is_one_line(tmp_path: Path) -> None:
    state_dir = _bare_state_dir(tmp_path)
    (state_dir / "run.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(StateError, match=f"^{state_dir / 'run.json'}: unreadable: JSON nested too deeply$"):
        main_audit(argparse.Namespace(state_dir=[str(state_dir)], json=False, output=None))


@pytest.mark.parametrize(
    ("where", "reason"),
    [("dir", "is a directory; name a file to write"), ("missing", "directory {tmp}/missing does not exist")],
)
def test_an_output_path_that_cannot_be_written_is_refused_before_the_audit(
    tmp_path: Path, where: str, reason: str
) -> None:
    state_dir = _bare_state_dir(tmp_path)
    out = {"dir": tmp_path, "missing": tmp_path / "missing" / "a.json"}[where]
    for dirs in ([str(state_dir)], [str(state_dir), str(state_dir)]):
        with pytest.raises(ConfigError, match="^--output: " + re.escape(reason.format(tmp=tmp_path))):
            main_audit(argparse.Namespace(state_dir=dirs, json=False, output=str(out)))


def test_the_cli_gives_one_line_and_exit_78_for_an_unreadable_state_dir(tmp_path: Path) -> None:
    state_dir = _bare_state_dir(tmp_path)
    (state_dir / "audit.log").unlink()
    (state_dir / "audit.log").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "melfeed", "audit", str(state_dir), "-o", str(tmp_path / "a.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 78 and not (tmp_path / "a.json").exists()
    assert proc.stderr.splitlines() == [
        f"melfeed audit: {state_dir}/audit.log: cannot read audit log: not a regular file (directory)"
    ]
