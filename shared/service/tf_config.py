"""Where this process sits in a multi-worker job: its rank and the world size, from ``TF_CONFIG``.

Role: the one reader of TensorFlow's cluster convention. ``TF_CONFIG`` (the environment variable, or
the file given as ``--tf-config FILE``, which wins) is a JSON object::

    {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]},
     "task": {"type": "worker", "index": 0}}

The training tasks are the chief (at most one) and the workers; they are numbered the way
``MultiWorkerMirroredStrategy`` numbers them (the chief first, then the workers by index), and that
number is the **rank**; the world size is how many there are. An ``evaluator`` may be listed in the
cluster (it trains nothing and is not counted); a process whose own task is the evaluator, or a
cluster with parameter servers (``ps``: another strategy), is refused.

Invariants:
    * No ``TF_CONFIG`` (unset, empty, or ``{}``: TensorFlow's "no cluster") is rank 0 of a world of 1,
      exactly today's single-consumer behaviour.
    * Anything else that is not a usable cluster is one ``ConfigError`` whose text starts with the
      source (``TF_CONFIG`` or ``--tf-config FILE``) and names the key: never a traceback (exit 78).
    * Pure: the environment is passed in; nothing here changes it.
Shutdown: nothing to release.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from melfeed.shared.errors import ConfigError
from melfeed.shared.yaml_safe import read_text_file

__all__ = ["ENV_NAME", "SINGLE_WORKER", "WorkerPlace", "parse_tf_config", "resolve_worker_place"]

ENV_NAME = "TF_CONFIG"
_TRAINING_TYPES = ("chief", "worker")  # in rank order: MultiWorkerMirroredStrategy's id_in_cluster
_KNOWN_TYPES = (*_TRAINING_TYPES, "evaluator", "ps")
_MAX_PORT = 65535
_Fail = Callable[..., ConfigError]


@dataclass(frozen=True, slots=True)
class WorkerPlace:
    """This process's place in the job: rank ``rank`` of ``world`` training tasks."""

    rank: int = 0  # 0 .. world-1: chief first (if any), then workers by index
    world: int = 1  # training tasks in the cluster (chief + workers)
    task_type: str = "worker"  # as TF_CONFIG names it: "chief" or "worker"
    task_index: int = 0  # as TF_CONFIG gives it
    cluster: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # task type -> host:port list
    source: str = "no TF_CONFIG"  # where it was read: "TF_CONFIG", "--tf-config FILE"

    @property
    def is_multi_worker(self) -> bool:
        return self.world > 1


SINGLE_WORKER = WorkerPlace()


def resolve_worker_place(tf_config_file: str | os.PathLike[str] | None, environ: Mapping[str, str]) -> WorkerPlace:
    """The place given by ``--tf-config FILE`` if set, else by ``environ["TF_CONFIG"]``, else rank 0 of 1.

    Raises:
        ConfigError: the file cannot be read, or the JSON is not a usable cluster (one line).
    """
    if tf_config_file is not None:
        source = f"--tf-config {os.fspath(tf_config_file)}"
        try:
            text = read_text_file(tf_config_file)
        except ConfigError as err:
            raise ConfigError(err.reason, path=(source,)) from None
        return parse_tf_config(text, source)
    text = environ.get(ENV_NAME, "")
    return parse_tf_config(text, ENV_NAME) if text.strip() else SINGLE_WORKER


def parse_tf_config(text: str, source: str) -> WorkerPlace:
    """Rank, world and cluster from the JSON text of a ``TF_CONFIG``; ``source`` names it in errors.

    Raises:
        ConfigError: invalid JSON, a missing or malformed ``cluster`` or ``task``, an index out of
            range, a task type that trains nothing here, a cluster with parameter servers.
    """

    def fail(message: str, got: Any = None) -> ConfigError:
        return ConfigError(message, path=(source,), got=got)

    try:
        doc = json.loads(text)
    except ValueError as err:
        raise fail(f"invalid JSON: {err}") from None
    except RecursionError:
        raise fail("invalid JSON: nested too deeply") from None
    if not isinstance(doc, dict):
        raise fail(f"must be a JSON object with 'cluster' and 'task', got a value of type {type(doc).__name__}")
    if not doc.get("cluster") and "task" not in doc:
        return SINGLE_WORKER  # TensorFlow's own reading of "{}": no cluster, one worker
    cluster = _read_cluster(doc.get("cluster"), fail)
    task_type, task_index = _read_task(doc.get("task"), cluster, fail)
    chiefs = len(cluster.get("chief", ()))
    world = chiefs + len(cluster.get("worker", ()))
    rank = task_index if task_type == "chief" else chiefs + task_index
    return WorkerPlace(rank, world, task_type, task_index, cluster, source)


def _read_cluster(raw: object, fail: _Fail) -> dict[str, tuple[str, ...]]:
    if not isinstance(raw, dict) or not raw:
        raise fail("'cluster' must be a non-empty object of task type -> list of host:port", got=raw)
    cluster: dict[str, tuple[str, ...]] = {}
    seen: set[str] = set()
    for kind, addresses in raw.items():
        if kind not in _KNOWN_TYPES:
            raise fail(f"cluster.{kind}: unknown task type (known: {', '.join(_KNOWN_TYPES)})")
        if kind == "ps":
            raise fail(
                "cluster.ps: parameter servers belong to ParameterServerStrategy; melfeed feeds "
                "MultiWorkerMirroredStrategy workers (chief and worker only)"
            )
        if not isinstance(addresses, list) or not addresses:
            raise fail(f"cluster.{kind} must be a non-empty list of host:port", got=addresses)
        for address in addresses:
            _check_address(address, kind, fail)
            if address in seen:
                raise fail(f"cluster.{kind}: {address} is listed twice")
            seen.add(address)
        cluster[kind] = tuple(addresses)
    if len(cluster.get("chief", ())) > 1:
        raise fail("cluster.chief: at most one chief", got=len(cluster["chief"]))
    if not any(kind in cluster for kind in _TRAINING_TYPES):
        raise fail("'cluster' lists no chief and no worker: nothing trains")
    return cluster


def _check_address(address: object, kind: str, fail: _Fail) -> None:
    if not isinstance(address, str):
        raise fail(f"cluster.{kind}: every address must be a host:port string", got=address)
    host, _, port = address.rpartition(":")
    if address != "".join(address.split()):  # " host:2222": TensorFlow would dial a host that is no host
        raise fail(f"cluster.{kind}: an address must not hold spaces", got=address)
    if not host or not port.isdigit() or not 1 <= int(port) <= _MAX_PORT:
        raise fail(f"cluster.{kind}: address must be host:port with a port 1..{_MAX_PORT}", got=address)


def _read_task(raw: object, cluster: dict[str, tuple[str, ...]], fail: _Fail) -> tuple[str, int]:
    if not isinstance(raw, dict):
        raise fail('\'task\' must be an object {"type": "worker", "index": N}', got=raw)
    task_type, index = raw.get("type"), raw.get("index", 0)
    if task_type == "evaluator":
        raise fail("task.type evaluator trains nothing: run no melfeed consumer there")
    if task_type not in _TRAINING_TYPES:
        raise fail("task.type must be 'chief' or 'worker'", got=task_type)
    if task_type not in cluster:
        raise fail(f"task.type {task_type} is not in the cluster")
    if isinstance(index, bool) or not isinstance(index, int):
        raise fail("task.index must be an integer", got=index)
    if not 0 <= index < len(cluster[task_type]):
        raise fail(
            f"task.index {index} is out of range: cluster.{task_type} has {len(cluster[task_type])} "
            f"task(s), indices 0..{len(cluster[task_type]) - 1}"
        )
    return task_type, index
