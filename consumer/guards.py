"""The library's argument checks: a mistake in a user's own loop is one clear error, never a deep traceback.

Role: what ``Consumer`` (``consumer/feed.py``) refuses before it touches a socket, the ring or a lease:
a config that is not a ``PipelineConfig``, a negative ``start_batch``, a wait without a bound; and what
failed behind it (the receiver thread, an owned producer group) as one ``PipelineError``. The rules are listed
in docs/guide/your-model.md ("When it goes wrong"). Programmer errors raise built-ins (``TypeError``,
``ValueError``, ``RuntimeError``); nothing here has state or threads.
"""

from __future__ import annotations

import numbers
import operator
from typing import TYPE_CHECKING, Any

from melfeed.shared.config import PipelineConfig
from melfeed.shared.errors import PipelineError

if TYPE_CHECKING:
    from melfeed.consumer.producer_group import OwnedProducers

__all__ = ["check_config", "check_start_batch", "check_timeout", "check_started", "check_receiver", "check_failures"]


def check_config(cfg: Any) -> PipelineConfig:
    """``cfg`` itself, or ``TypeError`` saying how to make one (a dict or a path is a common slip)."""
    if not isinstance(cfg, PipelineConfig):
        raise TypeError(
            f"Consumer(cfg): cfg must be a PipelineConfig (melfeed.load_config(path) "
            f"or melfeed.config_from_mapping(dict)), got {type(cfg).__name__}"
        )
    return cfg


def check_start_batch(start_batch: Any) -> int:
    """A plan position: an integer >= 0, numpy's included (the receiver would fail on its first lease otherwise)."""
    try:
        position = operator.index(start_batch)
    except TypeError:
        position = -1
    if isinstance(start_batch, bool) or position < 0:
        raise ValueError(f"Consumer(start_batch=...): a batch id >= 0, got {start_batch!r}")
    return position


def check_timeout(timeout_s: Any) -> float:
    """Seconds to wait as a float (0 or less: do not wait); ``None`` is refused: every wait is bounded."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
        raise TypeError(
            f"next_batch(timeout_s): seconds to wait (0 = do not wait), got {timeout_s!r}; "
            "melfeed never waits without a bound: call it again, or loop over batches()"
        )
    return float(timeout_s)


def check_started(started: bool) -> None:
    """``RuntimeError`` before ``start()``: nothing is bound, so no batch could ever arrive."""
    if not started:
        raise RuntimeError("Consumer.start() was not called: use `with Consumer(cfg) as feed:` or call feed.start()")


def check_receiver(error: BaseException | None) -> None:
    """The receiver thread's failure as ``PipelineError`` (it closed the ring as it failed)."""
    if error is not None:
        raise PipelineError(f"receiver failed: {error}") from error


def check_failures(receiver_error: BaseException | None, producers: OwnedProducers | None) -> None:
    """``PipelineError`` if the receiver failed or the producer group a ``Consumer`` owns exited (its exit code)."""
    check_receiver(receiver_error)
    if producers is not None and producers.error is not None:
        raise producers.error
