"""Pinning the ring slots: the CUDA runtime lookup, "not pinned" without a GPU, unpinned before a mapping goes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from melfeed.consumer.transport.pinning import HostPinner, cudart_candidates
from melfeed.consumer.transport.shm_slots import ShmSlots


def test_the_runtime_is_looked_up_in_the_nvidia_wheels_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = tmp_path / "nvidia" / "cuda_runtime" / "lib"
    wheel.mkdir(parents=True)
    (wheel / "libcudart.so.12").write_bytes(b"")
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    assert cudart_candidates()[0] == str(wheel / "libcudart.so.12")


def test_without_a_runtime_or_a_device_nothing_is_pinned_and_it_says_why() -> None:
    missing = HostPinner(library="/nonexistent/libcudart.so.12")
    assert missing.status == "not pinned: no CUDA runtime (libcudart) found" and not missing.is_active
    assert not missing.pin(np.zeros(4096, np.uint8)) and missing.pinned == 0
    here = HostPinner()  # this machine has no GPU: a runtime, if any, sees no device
    assert here.status.startswith("not pinned: ") and not here.is_active


class _Recorder(HostPinner):
    def __init__(self) -> None:
        self.pinned, self.status = 0, "test"
        self.events: list[Any] = []

    def pin(self, buf: np.ndarray) -> bool:
        self.events.append(("pin", buf.ctypes.data))
        return True

    def unpin(self, buf: np.ndarray) -> None:
        self.events.append(("unpin", buf.ctypes.data))


def test_every_slot_is_pinned_when_mapped_and_unpinned_on_retire_and_close(tmp_path: Path) -> None:
    pinner = _Recorder()
    slots = ShmSlots(tmp_path, 2, 4096, run_id=1, pinner=pinner)
    first = [slots.buffer(i).ctypes.data for i in range(2)]
    assert pinner.events == [("pin", first[0]), ("pin", first[1])]
    slots.retire(0)
    assert pinner.events[2:] == [("unpin", first[0]), ("pin", slots.buffer(0).ctypes.data)]
    slots.close()
    assert sorted(pinner.events[4:]) == sorted([("unpin", slots.buffer(0).ctypes.data), ("unpin", first[1])])
