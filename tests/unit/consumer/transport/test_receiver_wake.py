"""The receiver's wakes: one per released slot, and only when a lease waits for a slot.

No socket is bound: the receiver's session is the test rig's, and its eventfd is read directly.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from consumer.flow.decisions import SessionConfig
from consumer.transport.receiver import Receiver, ReceiverConfig
from shared.wire.buckets import BucketSet
from tests.unit.consumer.flow.session.session_rig import A, B, BUCKET, CONTRACT, EPOCH, Rig, ids


def _woken(receiver: Receiver) -> bool:
    try:
        os.eventfd_read(receiver._wake_fd)
    except BlockingIOError:
        return False
    return True


@pytest.fixture
def rig_receiver() -> tuple[Rig, Receiver]:
    rig = Rig(n_slots=2, window=2)
    buckets = BucketSet((BUCKET,), np.zeros(2, np.int16), 0, 0, 2 * BUCKET.max_frames)
    cfg = ReceiverConfig("ipc:///nonexistent/never-bound.sock", SessionConfig(CONTRACT, EPOCH, 1.0, 30.0, False))
    receiver = Receiver(cfg, rig.ring, rig.book, buckets)
    receiver._session = rig.session          # one session: the rig drives it, the receiver acts on it
    yield rig, receiver
    receiver.stop()


def test_a_freed_slot_wakes_the_receiver_only_when_a_lease_waits_for_one(
        rig_receiver: tuple[Rig, Receiver]) -> None:
    rig, receiver = rig_receiver
    rig.join(A)
    assert ids(rig.grant()[A]) == [0, 1]      # A's window is full and so is the ring
    receiver._grant(rig.clock())
    assert not receiver._slot_wake
    receiver.slot_freed()
    assert not _woken(receiver)               # A's next BATCH wakes the loop, which leases the slot then
    rig.join(B)                               # B has room, the ring has no slot: a release must wake
    receiver._grant(rig.clock())
    assert receiver._slot_wake
    receiver.slot_freed()
    assert _woken(receiver)


def test_release_wakes_once_and_mark_applied_alone_still_wakes(rig_receiver: tuple[Rig, Receiver]) -> None:
    rig, receiver = rig_receiver
    receiver._slot_wake = True
    receiver.mark_applied(0, wake=False)
    receiver.slot_freed()
    assert os.eventfd_read(receiver._wake_fd) == 1      # one wake for apply + release, not two
    receiver.mark_applied(1)
    assert _woken(receiver)
