"""The receiver's wakes: one per released slot, and only when a lease waits for a slot.

No socket is bound: the receiver's session is the test rig's, and its eventfd is read directly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

from melfeed.consumer.flow.decisions import ReceiverSessionConfig
from melfeed.consumer.transport.receiver import Receiver, ReceiverConfig
from melfeed.shared.wire.buckets import BucketSet
from tests.unit.consumer.flow.session.session_rig import BUCKET, CONTRACT, EPOCH, A, B, Rig, ids


def _woken(receiver: Receiver) -> bool:
    try:
        os.eventfd_read(receiver._wake_fd)
    except BlockingIOError:
        return False
    return True


@pytest.fixture
def rig_receiver() -> Iterator[tuple[Rig, Receiver]]:
    rig = Rig(n_slots=2, window=2)
    buckets = BucketSet((BUCKET,), np.zeros(2, np.int16), 0, 0, 2 * BUCKET.max_frames)
    cfg = ReceiverConfig(
        "ipc:///nonexistent/never-bound.sock", ReceiverSessionConfig(CONTRACT, EPOCH, 1.0, 30.0, False)
    )
    receiver = Receiver(cfg, rig.ring, rig.book, buckets)
    receiver._session = rig.session  # one session: the rig drives it, the receiver acts on it
    yield rig, receiver
    receiver.stop()


def test_a_freed_slot_wakes_the_receiver_only_when_a_lease_waits_for_one(rig_receiver: tuple[Rig, Receiver]) -> None:
    rig, receiver = rig_receiver
    rig.join(A)
    assert ids(rig.grant()[A]) == [0, 1]  # A's window is full and so is the ring
    receiver._grant(rig.clock())
    assert not receiver._slot_wake
    receiver.slot_freed()
    assert not _woken(receiver)  # A's next BATCH wakes the loop, which leases the slot then
    rig.join(B)  # B has room, the ring has no slot: a release must wake
    receiver._grant(rig.clock())
    assert receiver._slot_wake
    receiver.slot_freed()
    assert _woken(receiver)


def test_release_wakes_once_and_mark_applied_alone_still_wakes(rig_receiver: tuple[Rig, Receiver]) -> None:
    rig, receiver = rig_receiver
    receiver._slot_wake = True
    receiver.mark_applied(0, wake=False)
    receiver.slot_freed()
    assert os.eventfd_read(receiver._wake_fd) == 1  # one wake for apply + release, not two
    receiver.mark_applied(1)
    assert _woken(receiver)


def test_stop_never_closes_the_wake_fd_while_another_threads_write_to_it_is_in_flight(
    rig_receiver: tuple[Rig, Receiver], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step thread's wake() inside its write when stop() closed the fd would write into whatever file took the
    fd number next (a checkpoint, a socket): the close waits for the write in flight."""
    import threading

    _, receiver = rig_receiver
    inside, go_on, closed = threading.Event(), threading.Event(), threading.Event()
    real_write, real_close = os.eventfd_write, os.close

    def slow_write(fd: int, value: int) -> None:
        if threading.current_thread() is waker:  # the step thread's write stalls in the syscall
            inside.set()
            assert go_on.wait(30)
        real_write(fd, value)

    def watched_close(fd: int) -> None:
        if fd == wake_fd:
            closed.set()
        real_close(fd)

    wake_fd = receiver._wake_fd
    monkeypatch.setattr(os, "eventfd_write", slow_write)
    monkeypatch.setattr(os, "close", watched_close)
    waker = threading.Thread(target=receiver.wake)
    waker.start()
    assert inside.wait(30)
    stopper = threading.Thread(target=receiver.stop)
    stopper.start()
    assert not closed.wait(0.5), "stop() closed the eventfd while a write to it was in flight"
    go_on.set()
    waker.join(30)
    stopper.join(30)
    assert closed.is_set() and receiver._wake_fd == -1
