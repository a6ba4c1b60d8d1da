"""State files are for the service user and group only, whatever the umask.

Every test runs under umask 000 (a shell or test runner may have it): without explicit modes the
state directory would be 0777 and ``audit.log``, ``run.json`` and the checkpoints world-readable.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import tensorflow as tf

from melfeed.consumer.resume.filemode import make_private_dir, restrict, write_private
from melfeed.consumer.resume.state import RunState
from melfeed.consumer.transport.shm_slots import ShmSlots
from melfeed.shared.config.loader import config_from_mapping

pytestmark = pytest.mark.tf


@pytest.fixture(autouse=True)
def permissive_umask() -> Iterator[None]:
    old = os.umask(0o000)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _no_access_for_others(path: Path, most: int) -> None:
    mode = _mode(path)
    assert mode & ~most == 0, f"{path} is {oct(mode)}, allowed at most {oct(most)}"


def test_a_new_state_directory_and_its_missing_parents_are_0750(tmp_path: Path) -> None:
    cfg = config_from_mapping(
        {
            "cache_dir": str(tmp_path),
            "consumer": {"state_dir": str(tmp_path / "a" / "b" / "s"), "checkpoint_every_steps": 1},
        }
    )
    state = RunState.open(cfg, "f" * 16)
    assert state is not None
    v = tf.Variable([1.0, 2.0])
    state.record(0, [0], 1)
    state.checkpoint({"v": v}, 1)
    state.close()
    root = tmp_path / "a" / "b" / "s"
    for directory in (tmp_path / "a", tmp_path / "a" / "b", root):
        assert _mode(directory) == 0o750, directory
    for name in (".lock", "run.json", "audit.log"):
        assert _mode(root / name) == 0o640, name
    [ckpt] = root.glob("ckpt-*")
    assert _mode(ckpt) == 0o750
    files = list(ckpt.iterdir())
    assert {p.name for p in files} >= {"cursor.json", "vars.index"} and len(files) >= 3
    for path in files:
        assert _mode(path) == 0o640, path.name


def test_an_existing_state_directory_keeps_its_mode(tmp_path: Path) -> None:
    root = tmp_path / "s"
    root.mkdir(mode=0o700)
    make_private_dir(root)
    assert _mode(root) == 0o700


def test_write_private_replaces_a_leftover_wide_file(tmp_path: Path) -> None:
    path = tmp_path / "run.tmp"
    path.write_text("old")
    os.chmod(path, 0o666)
    write_private(path, b"new")
    assert (path.read_bytes(), _mode(path)) == (b"new", 0o640)


def test_restrict_narrows_but_never_widens(tmp_path: Path) -> None:
    wide, narrow = tmp_path / "wide", tmp_path / "narrow"
    wide.write_text("x")
    narrow.write_text("x")
    os.chmod(wide, 0o777)
    os.chmod(narrow, 0o600)
    restrict(wide)
    restrict(narrow)
    assert (_mode(wide), _mode(narrow)) == (0o640, 0o600)


def test_shm_slot_files_are_owner_only(tmp_path: Path) -> None:
    """Guard: producers run as the consumer's user (deploy/units), so slot files need no group access."""
    slots = ShmSlots(tmp_path, 3, 8192, 1)
    try:
        slots.retire(1)  # a new generation is created the same way
        for path in tmp_path.iterdir():
            _no_access_for_others(path, 0o600)
    finally:
        slots.close()
