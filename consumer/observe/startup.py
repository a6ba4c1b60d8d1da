"""What a consumer says once it is bound: endpoint, buckets, the partial-batch drop, the in-flight memory bound.

Role: the INFO lines ``Consumer.start()`` logs (docs/design.md, invariant 4: the consumer computes
and logs its memory bound at start). They go to the caller's logger, ``melfeed.consumer.feed``, the name the
README's quick start quotes them under. Pure formatting over the consumer's properties; no state, no threads.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from melfeed.consumer.feed import Consumer

__all__ = ["log_bound"]


def log_bound(log: logging.Logger, feed: Consumer) -> None:
    """Log the endpoint and buckets, the samples ``buckets.partial: drop`` leaves out, and the memory bound."""
    largest = feed.bucket_set.max_batch_nbytes()
    ring, window = feed.ring, feed.cfg.transport.lease_window
    log.info("consumer bound %s epoch=%d buckets=%s padding_efficiency=%.3f", feed.endpoint, feed.epoch,
             [b.as_wire() for b in feed.bucket_set.buckets], feed.bucket_set.padding_efficiency())
    if feed.plan.samples_dropped_per_epoch:
        log.info("buckets.partial drop: %d samples of each epoch left out (partial batches); %d batches per epoch",
                 feed.plan.samples_dropped_per_epoch, feed.plan.batches_per_epoch)
    if feed.shm is not None:
        log.info("in-flight memory bound: ring %d slots x %.1f MB in shared-memory files in %s; producers on "
                 "this path hold no send buffers (payload producers: lease window %d x %.1f MB each)",
                 ring.n_slots, ring.slot_nbytes / 1e6, feed.shm.directory, window, largest / 1e6)
    else:
        log.info("in-flight memory bound: ring %d slots x %.1f MB + lease window %d x %.1f MB per producer",
                 ring.n_slots, ring.slot_nbytes / 1e6, window, largest / 1e6)
