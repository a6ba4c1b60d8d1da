"""What the consumer writes has the same modes under umask 000 as under systemd's 0027, and the XLA cache
(whose programs TensorFlow loads) is refused when another user could plant files in it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from melfeed.consumer.observe.telemetry import open_metrics_file
from melfeed.consumer.placement import apply_placement
from melfeed.consumer.train.jit import MEMO_NAME, choose_mode, remember_mode
from melfeed.consumer.train.loop import TrainSummary
from melfeed.consumer.train.xla_attempts import ATTEMPTS_NAME, XlaAttempts
from melfeed.shared.config import PipelineConfig
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import ConfigError


def _mode(path: Path) -> int:
    return os.lstat(path).st_mode & 0o777


def _cfg(**consumer: Any) -> PipelineConfig:
    return config_from_mapping({"consumer": consumer})


def test_metrics_file_summary_jit_memo_and_xla_attempts_are_0640_under_umask_000(
    tmp_path: Path, umask_000: None
) -> None:
    with open_metrics_file(str(tmp_path / "m.jsonl")) as out:
        out.write("{}\n")
    TrainSummary(steps=3).write(tmp_path / "summary.json")
    TrainSummary(steps=4).write(tmp_path / "summary.json")  # written again at the end: replaced
    remember_mode(tmp_path, choose_mode("auto", xla_times_s=[0.03], graph_times_s=[0.02]))
    with XlaAttempts(tmp_path, "m:f").compiling("bucket A"):
        pass
    assert {p: _mode(tmp_path / p) for p in ("m.jsonl", "summary.json", MEMO_NAME, ATTEMPTS_NAME)} == {
        "m.jsonl": 0o640,
        "summary.json": 0o640,
        MEMO_NAME: 0o640,
        ATTEMPTS_NAME: 0o640,
    }
    assert '"steps": 4' in (tmp_path / "summary.json").read_text()


def test_an_existing_output_keeps_the_mode_its_owner_gave_it(tmp_path: Path, umask_000: None) -> None:
    for name in ("m.jsonl", "summary.json"):
        (tmp_path / name).write_text("")
        os.chmod(tmp_path / name, 0o600)
    with open_metrics_file(str(tmp_path / "m.jsonl")) as out:
        out.write("{}\n")
    TrainSummary().write(tmp_path / "summary.json")
    assert (_mode(tmp_path / "m.jsonl"), _mode(tmp_path / "summary.json")) == (0o600, 0o600)


def test_the_xla_cache_and_a_new_state_dir_are_private_under_umask_000(tmp_path: Path, umask_000: None) -> None:
    state = tmp_path / "new" / "state"
    apply_placement(_cfg(state_dir=str(state)), {}, modules={})
    assert [_mode(p) for p in (tmp_path / "new", state, state / "xla-cache")] == [0o750] * 3


def _refusal(cfg: PipelineConfig) -> str:
    env: dict[str, str] = {}
    with pytest.raises(ConfigError) as info:
        apply_placement(cfg, env, modules={})
    assert env == {} and "\n" not in str(info.value)  # nothing set: TensorFlow never sees the cache
    return str(info.value)


def test_a_cache_others_can_write_to_is_refused_naming_the_key(tmp_path: Path) -> None:
    shared = tmp_path / "team-cache"
    shared.mkdir()
    os.chmod(shared, 0o775)
    text = _refusal(_cfg(xla_cache_dir=str(shared)))
    assert text.startswith(
        f"consumer.xla_cache_dir: XLA compilation cache {shared.resolve()} is mode 0775: its group can write to it"
    )
    os.chmod(shared, 0o750)
    assert apply_placement(_cfg(xla_cache_dir=str(shared)), {}, modules={})  # the operator's fix is enough


def test_a_cache_planted_in_the_state_dir_is_refused_naming_the_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    (state / "xla-cache").symlink_to(theirs)  # followed by resolve(): their directory
    if os.geteuid() == 0:
        os.chown(theirs, 4242, -1)
    else:
        me = os.geteuid() + 1
        monkeypatch.setattr(os, "geteuid", lambda: me)
    text = _refusal(_cfg(state_dir=str(state)))
    assert text.startswith(
        f"consumer.state_dir: cannot use {theirs} as the XLA compilation cache: {theirs} belongs to uid "
    )
