"""A collective that failed because a peer is gone becomes one line naming the rank; other errors pass."""

from __future__ import annotations

import pytest
import tensorflow as tf

from consumer.job.cluster import Job, lost_contact_error
from shared.config_loader import config_from_mapping
from shared.errors import ConfigError, JobLostError, StepError
from shared.service.tf_config import WorkerPlace

_HEARTBEATS = ("Graph execution error:\n\nDetected at node CollectiveReduceV2 defined at (most recent call last):\n"
               '  File "/srv/melfeed/run_pipeline.py", line 55, in <module>\n\n'
               '  File "/srv/melfeed/consumer/train/replicas.py", line 173, in whole\n    per_replica = strategy.run(\n\n'
               "Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks are "
               "unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1\nThe tasks have crashed.\n"
               "\t [[{{node CollectiveReduceV2}}]]")


def test_a_peer_that_stopped_heartbeating_is_one_line_naming_this_rank_and_the_peer() -> None:
    err = lost_contact_error(tf.errors.UnavailableError(None, None, _HEARTBEATS), 0, "training")
    assert err is not None and "\n" not in str(err)
    assert str(err) == ("rank 0: lost contact with the job (training: Collective ops is aborted by: Error reported "
                        "from /job:worker/task:1: The following tasks are unhealthy (stopped sending heartbeats): "
                        "/job:worker/replica:0/task:1); restart every rank to resume from the newest common "
                        "checkpoint")
    timed_out = lost_contact_error(tf.errors.DeadlineExceededError(None, None, "Collective timed out"), 1, "x")
    assert timed_out is not None and str(timed_out).startswith("rank 1: lost contact with the job (x: Collective")


def test_other_errors_are_not_a_lost_peer() -> None:
    assert lost_contact_error(tf.errors.InvalidArgumentError(None, None, "bad shape"), 0, "training") is None
    assert lost_contact_error(ValueError("no"), 0, "training") is None



def test_a_failed_step_whose_cause_is_a_lost_peer_is_a_lost_job() -> None:
    job = Job(WorkerPlace(rank=1, world=2), None, config_from_mapping({}))
    with pytest.raises(JobLostError, match="rank 1: lost contact with the job"):
        with job.guard("training"):   # the hand-off wraps the step's TensorFlow error (consumer/train/handoff.py)
            raise StepError("m:f", "the step failed") from tf.errors.UnavailableError(None, None, _HEARTBEATS)
    with pytest.raises(StepError):
        with job.guard("training"):
            raise StepError("m:f", "the step failed") from tf.errors.InvalidArgumentError(None, None, "bad id")

@pytest.mark.parametrize("key, value, says", [
    ("peer_timeout_s", 0, "consumer.peer_timeout_s: must be in 1..3600 seconds"),
    ("peer_timeout_s", "soon", "consumer.peer_timeout_s: must be a number"),
    ("collective_timeout_s", 10, "consumer.collective_timeout_s: must be in consumer.peer_timeout_s..86400"),
])
def test_the_job_bounds_are_checked_when_the_config_loads(key: str, value: object, says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        config_from_mapping({"consumer": {key: value}})
    c = config_from_mapping({"consumer": {"peer_timeout_s": 5, "collective_timeout_s": 60}}).consumer
    assert (c.peer_timeout_s, c.collective_timeout_s) == (5.0, 60.0)
