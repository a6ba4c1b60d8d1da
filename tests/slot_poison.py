"""The slot-reuse guard's hook: every slot the ring releases is overwritten with garbage at once.

``scribble_on_release(ring)`` wraps ``BatchRing.release`` of one consumer's ring so the whole slot is
``0x7F`` (float32 3.4e38, int32 lengths of 2.1e9) before the slot can be leased again: a step that still
read a released slot would train on huge values. Used by the TensorFlow and the JAX staging tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

GARBAGE = 0x7F


def scribble_on_release(ring: Any) -> Callable[[], int]:
    """Wrap ``ring.release`` (this ring only); returns how many releases were overwritten so far."""
    release = ring.release
    count = 0

    def release_then_scribble(slot: int) -> None:
        nonlocal count
        ring.memory.buffer(slot)[:] = GARBAGE  # still IN_STEP: no producer writes it yet
        count += 1
        release(slot)

    ring.release = release_then_scribble
    return lambda: count
