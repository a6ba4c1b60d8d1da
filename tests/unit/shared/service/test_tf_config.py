"""Unit tests for shared/service/tf_config.py: rank and world from TF_CONFIG, one-line refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from melfeed.shared.errors import ConfigError
from melfeed.shared.service.tf_config import SINGLE_WORKER, parse_tf_config, resolve_worker_place


def _tf_config(task_type: str = "worker", index: object = 0, **cluster: object) -> str:
    return json.dumps(
        {
            "cluster": cluster or {"worker": ["h0:2222", "h1:2222", "h2:2222"]},
            "task": {"type": task_type, "index": index},
        }
    )


def test_no_tf_config_is_rank_0_of_a_world_of_1() -> None:
    assert resolve_worker_place(None, {}) == SINGLE_WORKER
    assert resolve_worker_place(None, {"TF_CONFIG": "  "}) == SINGLE_WORKER
    assert resolve_worker_place(None, {"TF_CONFIG": "{}"}) == SINGLE_WORKER  # TensorFlow's "no cluster"
    assert (SINGLE_WORKER.rank, SINGLE_WORKER.world, SINGLE_WORKER.is_multi_worker) == (0, 1, False)


def test_worker_index_is_the_rank_and_the_workers_are_the_world() -> None:
    place = resolve_worker_place(None, {"TF_CONFIG": _tf_config(index=2)})
    assert (place.rank, place.world, place.task_type, place.task_index) == (2, 3, "worker", 2)
    assert place.cluster == {"worker": ("h0:2222", "h1:2222", "h2:2222")} and place.source == "TF_CONFIG"


def test_the_chief_is_rank_0_and_workers_follow_it() -> None:
    cluster = {"chief": ["c:1"], "worker": ["w0:1", "w1:1"], "evaluator": ["e:1"]}
    assert parse_tf_config(_tf_config("chief", 0, **cluster), "x").rank == 0
    place = parse_tf_config(_tf_config("worker", 1, **cluster), "x")
    assert (place.rank, place.world) == (2, 3)  # the evaluator trains nothing: not counted


def test_the_file_wins_over_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "tf_config.json"
    path.write_text(_tf_config(index=1), encoding="utf-8")
    place = resolve_worker_place(path, {"TF_CONFIG": _tf_config(index=0)})
    assert place.rank == 1 and place.source == f"--tf-config {path}"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("{not json", "TF_CONFIG: invalid JSON"),
        ("[1, 2]", "must be a JSON object"),
        (json.dumps({"cluster": {"worker": ["h:1"]}}), "'task' must be an object"),
        (json.dumps({"task": {"type": "worker", "index": 0}}), "'cluster' must be a non-empty object"),
        (_tf_config(index=3), "task.index 3 is out of range: cluster.worker has 3 task(s), indices 0..2"),
        (_tf_config(index=-1), "task.index -1 is out of range"),
        (_tf_config(index="1"), "task.index must be an integer, got '1'"),
        (_tf_config(index=True), "task.index must be an integer"),
        (_tf_config("evaluator", 0, worker=["h:1"], evaluator=["e:1"]), "task.type evaluator trains nothing"),
        (_tf_config("ps", 0, worker=["h:1"], ps=["p:1"]), "cluster.ps: parameter servers"),
        (_tf_config("master", 0), "task.type must be 'chief' or 'worker', got 'master'"),
        (_tf_config("chief", 0), "task.type chief is not in the cluster"),
        (_tf_config(worker=["h:1", "h:1"]), "cluster.worker: h:1 is listed twice"),
        (_tf_config(worker=["h"]), "cluster.worker: address must be host:port"),
        (_tf_config(worker=["h:0"]), "address must be host:port with a port 1..65535"),
        (_tf_config(worker=[" h:1"]), "cluster.worker: an address must not hold spaces"),
        (_tf_config(worker=["h :1"]), "cluster.worker: an address must not hold spaces"),
        (_tf_config(worker=[7]), "every address must be a host:port string"),
        (_tf_config(worker=[]), "cluster.worker must be a non-empty list"),
        (_tf_config(worker=["h:1"], chief=["a:1", "b:1"]), "cluster.chief: at most one chief"),
        (_tf_config(worker=["h:1"], trainer=["t:1"]), "cluster.trainer: unknown task type"),
        (_tf_config("chief", 0, evaluator=["e:1"]), "lists no chief and no worker"),
        ("[" * 100000 + "]" * 100000, "TF_CONFIG: invalid JSON"),
    ],
)
def test_bad_tf_config_is_one_line_naming_the_source(text: str, says: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_worker_place(None, {"TF_CONFIG": text})
    message = str(info.value)
    assert message.startswith("TF_CONFIG: ") and says in message and "\n" not in message


def test_an_unreadable_file_is_one_line_naming_the_flag_and_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "absent.json"
    with pytest.raises(ConfigError, match=f"^--tf-config {missing}: cannot read config file"):
        resolve_worker_place(missing, {})
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):  # never blocks on the open
        resolve_worker_place(fifo, {})
    bad = tmp_path / "bad.json"
    bad.write_text('{"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 4}}', encoding="utf-8")
    with pytest.raises(ConfigError, match=f"^--tf-config {bad}: task.index 4 is out of range"):
        resolve_worker_place(bad, {"TF_CONFIG": _tf_config()})
