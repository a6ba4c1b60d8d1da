"""A producer that learns its rows in the handshake (``buckets.batch_size: auto`` without ``buckets.rows``): HELLO
asks with ``LEARN_ROWS``, each new epoch's WELCOME gives them, and a WELCOME whose rows it cannot build is refused."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from melfeed.producer.session import ProducerSession
from melfeed.shared.errors import EXIT_CONFIG
from melfeed.shared.wire.protocol import LEARN_ROWS, Heartbeat, Hello, Lease, LeaseGrant, Welcome
from tests.fakes import FakeClock
from tests.unit.producer.test_session import CFG, HB_S

LEARNING = dataclasses.replace(CFG, buckets=[[0, LEARN_ROWS, 100, 30], [1, LEARN_ROWS, 200, 60]], max_rows=64)


def _welcome(s: ProducerSession, epoch: int, rows: list[int] | None) -> Welcome:
    return Welcome(epoch, 2, HB_S, False, s.hello().nonce, None, rows)


def _started(clock: FakeClock) -> ProducerSession:
    s = ProducerSession(LEARNING, clock())
    [hello] = s.on_turn(clock())
    assert isinstance(hello, Hello) and [b[1] for b in hello.buckets] == [LEARN_ROWS, LEARN_ROWS]
    return s


def test_the_rows_come_with_each_epochs_welcome_and_are_learned_again_from_the_next() -> None:
    clock = FakeClock(100.0)
    s = _started(clock)
    assert LEARNING.learns_rows and not CFG.learns_rows and s.rows is None
    s.on_message(_welcome(s, 7, [16, 8]), clock())
    assert s.joined_epoch == 7 and s.rows == [16, 8]
    s.on_message(LeaseGrant(7, [Lease(0, 1, [3, 4], 5.0)], 1), clock())
    order = s.next_build(clock())
    assert order is not None and order.epoch == 7 and s.rows == [16, 8]
    s.on_message(Heartbeat(9), clock())  # a restarted consumer: leave epoch 7 and its rows
    assert s.joined_epoch is None and s.rows is None
    s.on_turn(clock())
    s.on_message(_welcome(s, 9, [32, 4]), clock())
    assert s.joined_epoch == 9 and s.rows == [32, 4] and s.exit_code == 0


def test_a_producer_naming_its_rows_ignores_rows_in_a_welcome() -> None:
    clock = FakeClock(100.0)
    s = ProducerSession(CFG, clock())
    s.on_turn(clock())
    s.on_message(_welcome(s, 7, [16]), clock())
    assert s.joined_epoch == 7 and s.rows is None


@pytest.mark.parametrize(
    ("rows", "why"),
    [
        (None, "carries no rows"),
        ([16], "gives rows for 1 buckets, this producer has 2"),
        ([16, 8, 4], "gives rows for 3 buckets, this producer has 2"),
        ([16, 65], "gives 65 rows, above this producer's buckets.max_batch_size 64"),
        ([2**31 - 1, 8], "above this producer's buckets.max_batch_size 64"),
    ],
    ids=["none", "short", "long", "over", "huge"],
)
def test_a_welcome_whose_rows_do_not_fit_is_refused_with_exit_78_and_nothing_joined(
    rows: list[int] | None, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(100.0)
    s = _started(clock)
    with caplog.at_level(logging.ERROR, logger="melfeed.producer.session"):
        s.on_message(_welcome(s, 7, rows), clock())
    assert s.exit_code == EXIT_CONFIG and why in s.reason
    assert s.joined_epoch is None and s.rows is None and s.farewell() is None
    s.on_message(LeaseGrant(7, [Lease(0, 0, [1], 5.0)], 1), clock())
    assert s.next_build(clock()) is None  # nothing built for the refused consumer
    assert any(why in r.getMessage() for r in caplog.records)
