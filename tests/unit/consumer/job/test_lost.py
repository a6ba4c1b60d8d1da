"""A collective that failed because a peer is gone becomes one line naming the rank; other errors pass. A rank
starved past the collective bound, a port in use and the ranks' gathered verdicts are one line too."""

from __future__ import annotations

import socket

import pytest
import tensorflow as tf

from melfeed.consumer.job.agree import REFUSED, job_settings, offer_row, settings_row
from melfeed.consumer.job.cluster import Job, lost_contact_error, server_error
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import ConfigError, JobLostError, StepError
from melfeed.shared.service.tf_config import WorkerPlace

pytestmark = pytest.mark.tf

_HEARTBEATS = (
    "Graph execution error:\n\nDetected at node CollectiveReduceV2 defined at (most recent call last):\n"
    '  File "/srv/melfeed/run_pipeline.py", line 55, in <module>\n\n'
    '  File "/srv/melfeed/consumer/train/replicas.py", line 173, in whole\n    per_replica = strategy.run(\n\n'
    "Collective ops is aborted by: Error reported from /job:worker/task:1: The following tasks are "
    "unhealthy (stopped sending heartbeats):\n/job:worker/replica:0/task:1\nThe tasks have crashed.\n"
    "\t [[{{node CollectiveReduceV2}}]]"
)


def test_a_peer_that_stopped_heartbeating_is_one_line_naming_this_rank_and_the_peer() -> None:
    err = lost_contact_error(tf.errors.UnavailableError(None, None, _HEARTBEATS), 0, "training")
    assert err is not None and "\n" not in str(err)
    assert str(err) == (
        "rank 0: lost contact with the job (training: Collective ops is aborted by: Error reported "
        "from /job:worker/task:1: The following tasks are unhealthy (stopped sending heartbeats): "
        "/job:worker/replica:0/task:1); restart every rank to resume from the newest common "
        "checkpoint"
    )
    timed_out = lost_contact_error(tf.errors.DeadlineExceededError(None, None, "Collective timed out"), 1, "x")
    assert timed_out is not None and str(timed_out).startswith("rank 1: lost contact with the job (x: Collective")


def test_other_errors_are_not_a_lost_peer() -> None:
    assert lost_contact_error(tf.errors.InvalidArgumentError(None, None, "bad shape"), 0, "training") is None
    assert lost_contact_error(ValueError("no"), 0, "training") is None


def test_a_failed_step_whose_cause_is_a_lost_peer_is_a_lost_job() -> None:
    job = Job(WorkerPlace(rank=1, world=2), None, config_from_mapping({}))
    with pytest.raises(JobLostError, match="rank 1: lost contact with the job"):
        with job.guard("training"):  # the hand-off wraps the step's TensorFlow error (consumer/train/handoff.py)
            raise StepError("m:f", "the step failed") from tf.errors.UnavailableError(None, None, _HEARTBEATS)
    with pytest.raises(StepError):
        with job.guard("training"):
            raise StepError("m:f", "the step failed") from tf.errors.InvalidArgumentError(None, None, "bad id")


def test_a_factory_whose_variables_could_not_be_broadcast_to_a_lost_peer_is_a_lost_job_not_a_config_error() -> None:
    """The step factory creates the variables, which MultiWorkerMirroredStrategy broadcasts from rank 0: a peer that
    died then failed the factory, which said 'model.step: the factory raised ...' and exit 78 (no systemd restart)."""
    job = Job(WorkerPlace(rank=0, world=2), None, config_from_mapping({}))
    bcast = tf.errors.UnavailableError(
        None,
        None,
        "{{function_node __wrapped__CollectiveBcastSend_device_/job:worker/"
        "replica:0/task:0/device:CPU:0}} Collective ops is aborted by: " + _HEARTBEATS,
    )
    with pytest.raises(JobLostError) as info:
        with job.guard("training"):
            raise ConfigError("the factory raised UnavailableError", path=("model", "step")) from bcast
    assert str(info.value).startswith("rank 0: lost contact with the job (training: Collective ops is aborted by: ")
    with pytest.raises(ConfigError):  # a factory that fails for its own reasons stays a config error
        with job.guard("training"):
            raise ConfigError("the factory raised ValueError", path=("model", "step")) from ValueError("no")


def test_a_rank_starved_of_data_past_the_collective_bound_ends_as_lost() -> None:
    """The other ranks wait for this one in a collective for at most consumer.collective_timeout_s; a rank starved
    longer than that waited on for good (its watchdog fed), and the restarted ranks could not form a new job."""
    job = Job(WorkerPlace(rank=1, world=2), None, config_from_mapping({"consumer": {"collective_timeout_s": 60}}))
    job.check_waiting(7, 0, now_s=100.0)
    job.check_waiting(7, 0, now_s=160.0)  # not past the bound yet
    job.check_waiting(8, 0, now_s=161.0)  # a batch came: the next wait starts afresh
    job.check_waiting(8, 0, now_s=220.0)
    with pytest.raises(JobLostError) as info:
        job.check_waiting(8, 0, now_s=221.5)
    assert str(info.value) == (
        "rank 1: lost contact with the job (training: no batch 8 from this rank's producers (alive: 0) for 60 s "
        "(consumer.collective_timeout_s), so the other ranks, which cannot step without this one, have given up); "
        "restart every rank to resume from the newest common checkpoint"
    )


def test_this_ranks_port_in_use_is_one_line_naming_the_address_not_a_traceback() -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    place = WorkerPlace(
        rank=1,
        world=2,
        task_type="worker",
        task_index=1,
        cluster={"worker": ("127.0.0.1:1", f"127.0.0.1:{port}")},
        source="--tf-config /etc/tf.json",
    )
    try:
        err = server_error(tf.errors.UnknownError(None, None, "Could not start gRPC server"), place)
    finally:
        held.close()
    assert isinstance(err, ConfigError)
    assert str(err).startswith(
        f"--tf-config /etc/tf.json: cluster.worker[1] 127.0.0.1:{port} is this rank's address, "
        f"where its TensorFlow server listens, but port {port}: Address already in use ("
    )
    assert server_error(tf.errors.UnknownError(None, None, "something else"), place) is None


def test_every_rank_stops_with_one_that_refuses_or_whose_settings_differ() -> None:
    """The settings and the resume step are gathered over the job (faked here: rank 0's row, then this rank's)."""
    job = Job(WorkerPlace(rank=1, world=2), None, config_from_mapping({}))
    ours = job_settings(config_from_mapping({"cache_dir": "/c"}), "ab")
    rank0: list[int] = settings_row(ours)
    offered: list[list[int]] = []

    def gather(row: list[int], doing: str) -> list[list[int]]:
        offered.append(row)
        return [rank0, row]

    job._gather_rows = gather  # type: ignore[method-assign]
    job.check_settings(ours)  # the same settings: nothing to say
    job.check_settings(None)  # this rank refuses: its own error is raised by the caller
    assert offered[-1] == settings_row(None)
    rank0 = settings_row(None)
    with pytest.raises(
        ConfigError,
        match=r"^rank 0 of the job refused to start \(its cache or config; the log of "
        r"rank 0 says why\): rank 1 stops too; fix rank 0, then start every rank",
    ):
        job.check_settings(ours)
    rank0 = settings_row(job_settings(config_from_mapping({"cache_dir": "/c", "seed": 3}), "ab"))
    with pytest.raises(ConfigError, match=r"^the ranks of this job differ in seed \(rank 1 differs from rank 0"):
        job.check_settings(ours)
    rank0 = offer_row(None)
    with pytest.raises(ConfigError, match=r"^rank 0 of the job refused to start \(its state directory;"):
        job.agree([20, 40])
    rank0 = offer_row([20, 40])
    assert job.agree([20, 40]) == 40


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("peer_timeout_s", 0, "consumer.peer_timeout_s: must be in 1..3600 seconds"),
        ("peer_timeout_s", "soon", "consumer.peer_timeout_s: must be a number"),
        ("collective_timeout_s", 10, "consumer.collective_timeout_s: must be in consumer.peer_timeout_s..86400"),
    ],
)
def test_the_job_bounds_are_checked_when_the_config_loads(key: str, value: object, says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        config_from_mapping({"consumer": {key: value}})
    c = config_from_mapping({"consumer": {"peer_timeout_s": 5, "collective_timeout_s": 60}}).consumer
    assert (c.peer_timeout_s, c.collective_timeout_s) == (5.0, 60.0)


def test_every_rank_plans_with_rank_0s_measured_weights_and_stops_with_one_that_refuses() -> None:
    """``buckets.cost: measured``: the weights travel as thousandths (faked gather: rank 0's row, then ours)."""
    job = Job(WorkerPlace(rank=1, world=2), None, config_from_mapping({}))
    rank0 = [250, 4]
    offered: list[list[int]] = []

    def gather(row: list[int], doing: str) -> list[list[int]]:
        offered.append(row)
        return [rank0, row]

    job._gather_rows = gather  # type: ignore[method-assign]
    assert job.agree_costs((0.3, 0.005)) == (0.25, 0.004)
    assert offered[-1] == [300, 5]
    rank0 = [REFUSED, REFUSED]  # rank 0 could not measure
    with pytest.raises(ConfigError, match=r"^rank 0 of the job refused to start \(its measured weights;"):
        job.agree_costs((0.3, 0.005))
    with pytest.raises(ConfigError):
        job.agree_costs(None)
    assert offered[-1] == [REFUSED, REFUSED]
