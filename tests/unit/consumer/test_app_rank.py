"""consumer/app.py ``worker_place``: the rank for ``run``/``consumer``, and ``--tf-config FILE`` exported as
TF_CONFIG."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from melfeed.consumer.app import worker_place
from melfeed.shared.errors import ConfigError


def test_a_tf_config_file_gives_the_rank_and_is_exported_for_tensorflow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 0}}')
    path = tmp_path / "tf.json"
    path.write_text(
        json.dumps({"cluster": {"chief": ["c:1"], "worker": ["w:1"]}, "task": {"type": "worker", "index": 0}}),
        encoding="utf-8",
    )
    place = worker_place(argparse.Namespace(tf_config=str(path)))
    assert (place.rank, place.world) == (1, 2)
    exported = json.loads(os.environ["TF_CONFIG"])
    assert exported == {"cluster": {"chief": ["c:1"], "worker": ["w:1"]}, "task": {"type": "worker", "index": 0}}


def test_without_a_file_the_environment_decides_and_nothing_is_exported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert (worker_place(argparse.Namespace()).rank, worker_place(argparse.Namespace(tf_config=None)).world) == (0, 1)
    assert "TF_CONFIG" not in os.environ
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": 1}}')
    with pytest.raises(ConfigError, match="^TF_CONFIG: task.index 1 is out of range"):
        worker_place(argparse.Namespace(tf_config=None))
