"""Another local user's traps, made for real: a sticky shared directory like /tmp, and links, files and
directories owned by another uid (``MALLORY``) in it. Making another user's files needs root: tests that
use these are marked ``needs_root`` (the suite runs as root in CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

MALLORY = 4242  # a uid no process of the test runs as
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="making another user's files needs root")


def sticky_dir(parent: Path, name: str = "tmp") -> Path:
    """A world-writable sticky directory of root's, as /tmp: anyone may create entries, only their owner move them."""
    path = parent / name
    path.mkdir()
    os.chmod(path, 0o1777)
    return path


def victim(parent: Path, text: str = "alias ls='ls --color'\n") -> Path:
    """A file of ours that a write through a planted link would destroy (``~alice/.bashrc``)."""
    home = parent / "home"
    home.mkdir(mode=0o700, exist_ok=True)
    path = home / ".bashrc"
    path.write_text(text)
    return path


def plant_link(link: Path, target: Path) -> Path:
    """``link`` -> ``target``, owned by MALLORY (``lchown``: the link itself, not its target)."""
    link.symlink_to(target)
    os.lchown(link, MALLORY, MALLORY)
    return link


def plant_file(path: Path, text: str = "mallory was here\n") -> Path:
    """A regular file of MALLORY's, writable by everyone, where we are about to write."""
    path.write_text(text)
    os.chown(path, MALLORY, MALLORY)
    os.chmod(path, 0o666)
    return path


def plant_dir(path: Path, mode: int = 0o777) -> Path:
    """A directory of MALLORY's."""
    path.mkdir()
    os.chown(path, MALLORY, MALLORY)
    os.chmod(path, mode)
    return path
