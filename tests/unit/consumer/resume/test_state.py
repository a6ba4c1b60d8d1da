"""Audit arithmetic, the audit log file, checkpoint commit/fallback/prune and the state directory."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from melfeed.consumer.resume.audit import RECORD_BYTES, AuditLog, AuditRecord, analyse, read_records, sample_digest
from melfeed.consumer.resume.checkpoint import CheckpointStore, Cursor, latest_checkpoint, list_checkpoints
from melfeed.consumer.resume.state import RunState
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import StateError

pytestmark = pytest.mark.tf


def _recs(*ids: int) -> list[AuditRecord]:
    return [AuditRecord(b, i + 1, 7, sample_digest([b])) for i, b in enumerate(ids)]


def test_analyse_counts_lost_duplicated_and_out_of_order_by_hand() -> None:
    assert analyse(_recs(0, 1, 2, 3)).ok
    res = analyse(_recs(0, 1, 1, 3, 2, 5), expected_end=7)
    # 4 and 6 never applied; the second 1 repeats; 1-after-1 and 2-after-3 go backwards.
    assert (res.lost, res.duplicated, res.out_of_order, res.expected) == (2, 1, 2, 7)
    assert not res.ok


def test_analyse_checks_content_against_the_plan_digests() -> None:
    digests = {b: sample_digest([b]) for b in range(3)}
    assert analyse(_recs(0, 1, 2), digests).wrong_content == 0
    digests[1] = sample_digest([99])
    assert analyse(_recs(0, 1, 2), digests).wrong_content == 1


def test_audit_log_appends_fixed_records_and_truncates_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "audit.log"
    log = AuditLog(path)
    for b in range(5):
        log.append(b, b + 1, 0xABC, sample_digest([b]))
    log.close()
    with open(path, "ab") as f:
        f.write(b"00000000")  # a record torn by SIGKILL
    records, torn = read_records(path)
    assert [r.batch_id for r in records] == list(range(5)) and torn == 8
    log = AuditLog(path)
    assert log.truncate_to(3) == 2
    log.close()
    assert path.stat().st_size == 3 * RECORD_BYTES
    with pytest.raises(StateError, match="holds 3 records but the checkpoint counts 4"):
        AuditLog(path).truncate_to(4)


def _cursor(n: int) -> Cursor:
    return Cursor(n, n, 0, "f" * 16, 1, 0.0)


def test_checkpoints_commit_atomically_fall_back_and_prune(tmp_path: Path) -> None:
    v = tf.Variable([1.0, 2.0])
    (tmp_path / "ckpt-000000000009.tmp-123").mkdir()  # left by a crash mid-write
    store = CheckpointStore(tmp_path, keep=2)
    assert not list(tmp_path.glob("*.tmp-*"))
    for n in (3, 6, 9):
        v.assign([float(n), 0.0])
        store.save(_cursor(n), {"v": v})
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-000000000006", "ckpt-000000000009"]
    (tmp_path / "ckpt-000000000009" / "cursor.json").write_text("{torn")
    path, cursor = latest_checkpoint(tmp_path) or (None, None)
    assert path is not None and cursor is not None and cursor.next_batch == 6
    CheckpointStore.restore(path, {"v": v})
    assert v.numpy().tolist() == [6.0, 0.0]
    with pytest.raises(StateError, match="does not fit this model"):
        CheckpointStore.restore(path, {"v": tf.Variable([1.0, 2.0, 3.0])})


def test_a_failed_checkpoint_write_is_not_fatal_and_keeps_the_previous_one(tmp_path: Path) -> None:
    v = tf.Variable(1.0)
    store = CheckpointStore(tmp_path, keep=2)
    store.save(_cursor(4), {"v": v})
    (tmp_path / f"ckpt-000000000008.tmp-{os.getpid()}").write_text("a file where the temp dir must go")
    with pytest.raises(StateError) as err:
        store.save(_cursor(8), {"v": v})
    assert not err.value.fatal and "previous checkpoint is intact" in str(err.value)
    found = latest_checkpoint(tmp_path)
    assert found is not None and found[1].next_batch == 4


def _cfg(tmp_path: Path, **top: object):  # type: ignore[no-untyped-def]
    return config_from_mapping(
        {"cache_dir": str(tmp_path), "consumer": {"state_dir": str(tmp_path / "s"), "checkpoint_every_steps": 2}, **top}
    )


def test_run_state_resumes_at_the_checkpoint_and_drops_later_records(tmp_path: Path) -> None:
    v = tf.Variable(0.0)
    state = RunState.open(_cfg(tmp_path), "f" * 16)
    assert state is not None and state.next_batch == 0 and not state.resumed
    for b in range(5):
        state.record(b, [b], 1)
        if state.due():
            v.assign(float(b))
            state.checkpoint({"v": v}, 1)
    state.close()  # "crash": batch 4 applied after the last checkpoint
    state = RunState.open(_cfg(tmp_path), "f" * 16)
    assert state is not None and state.next_batch == 4 and state.resumed
    state.restore_into({"v": v})
    state.close()
    records, _ = read_records(tmp_path / "s" / "audit.log")
    assert [r.batch_id for r in records] == [0, 1, 2, 3]


def test_run_state_is_exclusive_and_refuses_another_plan(tmp_path: Path) -> None:
    first = RunState.open(_cfg(tmp_path), "f" * 16)
    with pytest.raises(StateError, match=f"in use by another consumer \\(pid {os.getpid()}\\)"):
        RunState.open(_cfg(tmp_path), "f" * 16)
    assert first is not None
    first.close()
    first.close()  # idempotent
    with pytest.raises(StateError, match="fingerprint='ffffffffffffffff', the config has 'eeee") as err:
        RunState.open(_cfg(tmp_path), "e" * 16)
    assert err.value.fatal
    with pytest.raises(StateError, match="buckets="):
        RunState.open(_cfg(tmp_path, buckets={"batch_size": 8}), "f" * 16)
    assert json.loads((tmp_path / "s" / "run.json").read_text())["fingerprint"] == "f" * 16
    assert RunState.open(config_from_mapping({"cache_dir": str(tmp_path)}), "f" * 16) is None


def test_audit_command_prints_the_counts_and_fails_on_a_repeated_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from melfeed.consumer.resume.audit import main_audit

    state = RunState.open(_cfg(tmp_path), "f" * 16)
    assert state is not None
    for b in (0, 1, 2, 2, 3):
        state.record(b, [b], 1)
    state.close()
    assert (
        main_audit(argparse.Namespace(state_dir=str(tmp_path / "s"), json=False, output=str(tmp_path / "a.json"))) == 1
    )
    out = capsys.readouterr().out
    assert "lost 0 | duplicated 1 | out of order 1 | wrong content 0" in out and "FAILED" in out
    assert "plan content not checked" in out  # tmp_path holds no manifest: ids and order only
    assert json.loads((tmp_path / "a.json").read_text())["ok"] is False


def test_a_failed_periodic_checkpoint_is_counted_and_retried_while_a_failed_final_one_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import errno

    import melfeed.consumer.resume.checkpoint as checkpoint_module
    from melfeed.consumer.resume.filemode import write_private as real_write

    failing = {"left": 1}

    def write_cursor(path: Path, data: bytes) -> None:  # the cursor write fails after the variables
        if failing["left"] > 0:
            failing["left"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, data)

    monkeypatch.setattr(checkpoint_module, "write_private", write_cursor)
    v = tf.Variable(0.0)
    state = RunState.open(_cfg(tmp_path), "f" * 16)  # checkpoint every 2 steps
    assert state is not None
    tried_at = []
    with caplog.at_level("WARNING", logger="melfeed.consumer.resume.state"):
        for b in range(7):
            v.assign(float(b + 1))  # the variables after applying batch b
            state.record(b, [b], 1)
            if state.due():
                tried_at.append(b + 1)
                state.checkpoint({"v": v}, 1)  # periodic: never raises
    assert tried_at == [2, 4, 6]  # the failed try at 2 is retried one interval later
    assert state.checkpoint_failures == 1
    assert "periodic checkpoint failed" in caplog.text and "errno ENOSPC" in caplog.text
    assert "ckpt-000000000002.tmp-" in caplog.text  # the path it could not write
    assert [p.name for p in list_checkpoints(tmp_path / "s")] == ["ckpt-000000000004", "ckpt-000000000006"]
    assert not list((tmp_path / "s").glob("*.tmp-*"))
    failing["left"] = 1
    with pytest.raises(StateError, match="checkpoint write failed") as err:
        state.checkpoint({"v": v}, 1)  # the final one (batch 6 is not in a checkpoint)
    assert not err.value.fatal and "\n" not in str(err.value)
    state.close()
    state = RunState.open(_cfg(tmp_path), "f" * 16)  # the committed cursor matches its variables
    assert state is not None and state.next_batch == 6
    state.restore_into({"v": v})
    assert float(v.numpy()) == 6.0
    state.close()


def test_checkpoint_final_false_is_periodic_even_without_due(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: object) -> None:
        raise StateError(tmp_path, "checkpoint write failed (injected)", fatal=False) from OSError(5, "EIO")

    state = RunState.open(_cfg(tmp_path), "f" * 16)
    assert state is not None
    monkeypatch.setattr(state, "_commit", fail)
    state.record(0, [0], 1)
    state.checkpoint({}, 1, final=False)
    assert state.checkpoint_failures == 1
    with pytest.raises(StateError):
        state.checkpoint({}, 1, final=True)
    state.close()


def test_run_state_refuses_another_partial_policy_and_reads_an_older_run_json_as_pad(tmp_path: Path) -> None:
    first = RunState.open(_cfg(tmp_path), "f" * 16)  # buckets.partial: pad (the default)
    assert first is not None
    first.close()
    run_json = tmp_path / "s" / "run.json"
    assert json.loads(run_json.read_text())["buckets"]["partial"] == "pad"
    with pytest.raises(StateError, match="buckets=.*'partial': 'pad'.*'partial': 'drop'"):
        RunState.open(_cfg(tmp_path, buckets={"partial": "drop"}), "f" * 16)
    older = json.loads(run_json.read_text())
    del older["buckets"]["partial"]  # a run.json without buckets.partial
    run_json.write_text(json.dumps(older))
    again = RunState.open(_cfg(tmp_path), "f" * 16)
    assert again is not None
    again.close()
    with pytest.raises(StateError, match="buckets="):
        RunState.open(_cfg(tmp_path, buckets={"partial": "drop"}), "f" * 16)


def test_a_rank_resumes_at_the_jobs_common_step_with_its_cursor_and_audit_and_drops_newer_checkpoints(
    tmp_path: Path,
) -> None:
    v = tf.Variable(0.0)
    cfg = _cfg(
        tmp_path, consumer={"state_dir": str(tmp_path / "s"), "checkpoint_every_steps": 2, "keep_checkpoints": 3}
    )
    state = RunState.open(cfg, "f" * 16, rank=1, world=2)
    assert state is not None
    for b in range(7):
        state.record(b, [b], 1)
        if state.due():
            v.assign(float(b))
            state.checkpoint({"v": v}, 1)
    state.close()  # checkpoints at 2, 4, 6; batch 6 applied after the last
    state = RunState.open(cfg, "f" * 16, rank=1, world=2)
    assert state is not None and state.committed_steps() == [2, 4, 6] and state.next_batch == 6
    state.resume_at(4)  # the other rank never committed 6
    assert state.next_batch == 4 and state.committed_steps() == [2, 4]
    state.restore_into({"v": v})
    assert float(v.numpy()) == 3.0  # the variables of checkpoint 4 (batch 3 was its last)
    for b in (4, 5):  # training on: the next checkpoint is 2 steps on again
        state.record(b, [b], 2)
    assert state.due()
    state.close()
    records, _ = read_records(tmp_path / "s" / "audit.log")
    assert [r.batch_id for r in records] == [0, 1, 2, 3, 4, 5]  # 4 and 5 of the abandoned lineage are gone once


def test_a_rank_without_the_common_step_or_with_state_in_a_new_job_is_refused(tmp_path: Path) -> None:
    v = tf.Variable(0.0)
    state = RunState.open(_cfg(tmp_path), "f" * 16)
    assert state is not None
    for b in range(2):
        state.record(b, [b], 1)
    state.checkpoint({"v": v}, 1)
    with pytest.raises(StateError, match="the job resumes from step 8, but this rank cannot read that checkpoint"):
        state.resume_at(8)
    with pytest.raises(StateError, match="the job starts from scratch but this rank has checkpoints"):
        state.resume_at(None)
    state.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="directories of another user need root to make")
def test_a_state_directory_another_user_could_change_is_refused_and_nothing_in_it_is_touched(tmp_path: Path) -> None:
    foreign = tmp_path / "s"  # e.g. /tmp/state pre-made by another user
    foreign.mkdir()
    foreign.chmod(0o777)
    os.chown(foreign, 65534, 65534)
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    (foreign / ".lock").symlink_to(victim)  # the other user's trap for our lock file
    with pytest.raises(StateError, match=f"{foreign} belongs to uid 65534, not to this user") as err:
        RunState.open(_cfg(tmp_path), "f" * 16)
    assert err.value.fatal and victim.read_text() == "keep me"
    os.chown(foreign, os.geteuid(), os.getegid())  # ours, but writable by every user
    with pytest.raises(StateError, match="is mode 0777: other users can write to it"):
        RunState.open(_cfg(tmp_path), "f" * 16)
    foreign.chmod(0o750)  # ours and private: a link left inside is never followed
    with pytest.raises(StateError, match="cannot use as state directory"):
        RunState.open(_cfg(tmp_path), "f" * 16)
    assert victim.read_text() == "keep me"


@pytest.mark.skipif(os.geteuid() != 0, reason="directories of another user need root to make")
def test_a_state_directory_whose_parent_another_user_could_change_is_refused(tmp_path: Path) -> None:
    parent = tmp_path / "shared"
    parent.mkdir()
    parent.chmod(0o777)  # every user may rename entries: not sticky
    cfg = config_from_mapping({"cache_dir": str(tmp_path), "consumer": {"state_dir": str(parent / "s")}})
    with pytest.raises(StateError, match=f"its parent {parent} is mode 0777 without the sticky bit"):
        RunState.open(cfg, "f" * 16)
    parent.chmod(0o1777)  # sticky, as /tmp: only an entry's owner may move it
    state = RunState.open(cfg, "f" * 16)
    assert state is not None
    state.close()
    os.chown(parent, 65534, 65534)  # another user's directory, even a sticky one
    with pytest.raises(StateError, match=f"its parent {parent} belongs to uid 65534, who could move it"):
        RunState.open(cfg, "f" * 16)


def test_a_run_json_from_before_the_2d_planner_is_refused_under_it_and_resumes_with_num_buckets(tmp_path: Path) -> None:
    first = RunState.open(_cfg(tmp_path, buckets={"num_buckets": 4}), "f" * 16)
    assert first is not None
    first.close()
    run_json = tmp_path / "s" / "run.json"
    older = json.loads(run_json.read_text())
    for key in ("max_shapes", "token_cost", "attention_cost", "max_frames_per_token", "min_frames_per_token"):
        del older["buckets"][key]  # a run.json without the 2-D planner's keys
    run_json.write_text(json.dumps(older))
    with pytest.raises(StateError, match=r"buckets=\{'num_buckets': 4\}, the config has \{'num_buckets': None\}"):
        RunState.open(_cfg(tmp_path), "f" * 16)  # the default now plans in 2-D
    again = RunState.open(_cfg(tmp_path, buckets={"num_buckets": 4}), "f" * 16)
    assert again is not None
    again.close()


def test_outliers_report_lists_each_left_out_utterance_with_its_reason(tmp_path: Path) -> None:
    from melfeed.shared.config import BucketConfig
    from melfeed.shared.wire.buckets import build_buckets
    from melfeed.shared.wire.outliers import excluded

    frames, tokens = np.array([100, 100, 900, 100]), np.array([20, 2, 150, 20])
    cfg = BucketConfig(max_frames_per_token=10.0, max_frames=400, overlong="drop")
    bs = build_buckets(frames, tokens, 80, cfg)
    rows = [(f"u{i}", int(frames[i]), int(tokens[i]), r) for i, r in excluded(frames, tokens, bs.assignment, cfg)]
    state = RunState.open(_cfg(tmp_path), "f" * 16)
    assert state is not None
    path = state.write_outliers(rows)
    state.close()
    assert (
        path.read_text() == "id\tframes\ttokens\treason\nu1\t100\t2\tmax_frames_per_token\nu2\t900\t150\tmax_frames\n"
    )
