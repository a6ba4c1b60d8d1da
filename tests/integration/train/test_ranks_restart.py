"""A rank of a MultiWorkerMirroredStrategy job SIGKILLed mid-run, after a checkpoint: the other rank gives up
on its own within consumer.peer_timeout_s (one line, exit 75), both restart from the newest checkpoint both
committed, both ranks apply every batch from the common checkpoint on again, `audit A B` is exact and the final
variables are the same bytes on both ranks."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from melfeed.shared.errors import EXIT_JOB_LOST
from tests import job_procs, procs

_STEPS = 100
_KILL_AFTER = 2 * job_procs.CHECKPOINT_EVERY + 6  # records of rank 1: past its second checkpoint
_TIMEOUT_S = 300.0  # two TensorFlow processes on a loaded 2-core machine; a real hang only
_EXIT_SLACK_S = 30.0  # beyond peer_timeout_s: noticing, then stopping producers and exiting on a loaded machine


@pytest.mark.slow  # a chaos run (SIGKILL of a rank, two TensorFlow processes, two restarts): 45 s of the CI budget
def test_a_killed_rank_ends_the_other_in_bounded_time_and_both_resume_exactly(demo_cache: Path, tmp_path: Path) -> None:
    job = job_procs.Job(tmp_path, demo_cache, _STEPS)
    survivor, victim = job.start_all()
    assert procs.wait_for_records(job.state(1), _KILL_AFTER, victim, _TIMEOUT_S), job.tails()
    victim.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    victim.wait(procs.WAIT_S)
    code = survivor.wait(job_procs.PEER_TIMEOUT_S + _EXIT_SLACK_S + 60)  # the assertion below is the bound
    gave_up_s = time.monotonic() - killed_at
    text = job.log(0).read_text(errors="replace")
    assert code == EXIT_JOB_LOST, job.tails()
    assert gave_up_s < job_procs.PEER_TIMEOUT_S + _EXIT_SLACK_S, gave_up_s
    line = next((x for x in text.splitlines() if "lost contact" in x), "")
    assert line.startswith("melfeed run: rank 0: lost contact with the job (training: ") and line.endswith(
        "); restart every rank to resume from the newest common checkpoint"
    ), job.tails()
    assert "Traceback" not in text and 'File "' not in line, line  # TensorFlow's reason, not its frames
    first = [job.applied(rank) for rank in (0, 1)]
    assert len(first[1]) >= _KILL_AFTER

    restarted = job.start_all()
    assert [p.wait(_TIMEOUT_S) for p in restarted] == [0, 0], job.tails()
    for rank in (0, 1):
        assert f"rank {rank} of 2: the job resumes from step {2 * job_procs.CHECKPOINT_EVERY}" in job.log(
            rank
        ).read_text(errors="replace"), job.tails()
    again = [job.applied(rank)[len(first[rank]) :] for rank in (0, 1)]  # the restart's: from the common checkpoint
    assert again[0] == again[1] == list(range(2 * job_procs.CHECKPOINT_EVERY, _STEPS))
    assert job.variables_bytes(0) == job.variables_bytes(1)
    code, doc, text = job.audit()
    assert code == 0, text
    assert doc["total"]["expected"] == doc["total"]["applied"] == 2 * _STEPS
