"""A producer that learns its whole plan in the handshake (``buckets.cost: measured``): HELLO has no buckets, each new
epoch's WELCOME gives the weights and the consumer's shapes, the producer plans its own with those weights and joins
only when they are the same; anything else is refused with exit 78 and nothing joined."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from melfeed.producer.session import ProducerSession
from melfeed.shared.errors import EXIT_CONFIG, ConfigError
from melfeed.shared.wire.buckets import Bucket
from melfeed.shared.wire.protocol import Heartbeat, Hello, Lease, LeaseGrant, Welcome
from tests.fakes import FakeClock
from tests.unit.producer.test_session import CFG, HB_S

LEARNING = dataclasses.replace(CFG, buckets=[])
PLANS = {  # what the fake planner plans with each pair of weights (one row each: the WELCOME's rows are applied)
    (0.5, 0.002): (Bucket(0, 1, 104, 40, 80), Bucket(1, 1, 200, 60, 80)),
    (1.0, 0.0): (Bucket(0, 1, 200, 60, 80),),
}


class FakePlanner:
    """Plans ``PLANS[costs]`` with the rows it is given (when they fit), as ``CostPlanner`` does; records each call."""

    def __init__(self, error: ConfigError | None = None) -> None:
        self.calls: list[tuple[tuple[float, float], list[int]]] = []
        self.error = error

    def __call__(self, costs: tuple[float, float], rows: list[int]) -> tuple[Bucket, ...]:
        self.calls.append((costs, rows))
        if self.error is not None:
            raise self.error
        planned = PLANS[costs]
        if len(rows) != len(planned):
            return planned
        return tuple(dataclasses.replace(b, batch_size=r) for b, r in zip(planned, rows))


def _wire(costs: tuple[float, float], rows: list[int]) -> list[list[int]]:
    return [[b.index, r, *b.as_wire()[2:]] for b, r in zip(PLANS[costs], rows)]


def _welcome(s: ProducerSession, epoch: int, costs: list[float] | None, buckets: list[list[int]] | None) -> Welcome:
    return Welcome(epoch, 2, HB_S, False, s.hello().nonce, None, None, costs, buckets)


def _started(clock: FakeClock, planner: FakePlanner) -> ProducerSession:
    s = ProducerSession(LEARNING, clock(), planner=planner)
    [hello] = s.on_turn(clock())
    assert isinstance(hello, Hello) and hello.buckets == [] and hello.learns_plan
    return s


def test_the_plan_comes_with_each_epochs_welcome_and_is_learned_again_from_the_next(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, planner = FakeClock(100.0), FakePlanner()
    s = _started(clock, planner)
    assert LEARNING.learns_plan and not CFG.learns_plan and not LEARNING.learns_rows and s.buckets is None
    with caplog.at_level(logging.INFO, logger="melfeed.producer.session"):
        s.on_message(_welcome(s, 7, [0.5, 0.002], _wire((0.5, 0.002), [16, 8])), clock())
    assert s.joined_epoch == 7 and s.exit_code == 0 and planner.calls == [((0.5, 0.002), [16, 8])]
    assert s.buckets is not None and [b.as_wire() for b in s.buckets] == _wire((0.5, 0.002), [16, 8])
    assert "plan learned from consumer 7: token_cost 0.5 attention_cost 0.002, 2 shapes" in caplog.messages
    s.on_message(LeaseGrant(7, [Lease(0, 1, [3, 4], 5.0)], 1), clock())
    order = s.next_build(clock())
    assert order is not None and order.epoch == 7
    s.on_message(Heartbeat(9), clock())  # a restarted consumer (other weights, maybe): leave epoch 7 and its plan
    assert s.joined_epoch is None and s.buckets is None
    s.on_turn(clock())
    s.on_message(_welcome(s, 9, [1.0, 0.0], _wire((1.0, 0.0), [32])), clock())
    assert s.joined_epoch == 9 and s.exit_code == 0 and planner.calls[-1] == ((1.0, 0.0), [32])
    assert s.buckets is not None and [b.as_wire() for b in s.buckets] == [[0, 32, 200, 60, 80]]


def test_a_repeated_welcome_of_the_joined_epoch_plans_nothing_again() -> None:
    clock, planner = FakeClock(100.0), FakePlanner()
    s = _started(clock, planner)
    welcome = _welcome(s, 7, [0.5, 0.002], _wire((0.5, 0.002), [16, 8]))
    s.on_message(welcome, clock())
    s.on_message(welcome, clock())  # the answer to a HELLO we repeated
    assert s.joined_epoch == 7 and len(planner.calls) == 1


def test_a_producer_naming_its_shapes_ignores_a_plan_in_a_welcome() -> None:
    clock = FakeClock(100.0)
    s = ProducerSession(CFG, clock())
    s.on_turn(clock())
    s.on_message(_welcome(s, 7, [0.5, 0.002], _wire((0.5, 0.002), [16, 8])), clock())
    assert s.joined_epoch == 7 and s.buckets is None


def test_a_session_that_learns_its_plan_needs_a_planner() -> None:
    with pytest.raises(ValueError, match="planner"):
        ProducerSession(LEARNING, 0.0)


@pytest.mark.parametrize(
    ("costs", "buckets", "why"),
    [
        (None, None, "carries no plan (costs and buckets)"),
        ([0.5, 0.002], None, "carries no plan"),
        (None, _wire((0.5, 0.002), [16, 8]), "carries no plan"),
        (  # weights that plan other shapes here: another cache, version or setting
            [1.0, 0.0],
            _wire((0.5, 0.002), [16, 8]),
            "plans shapes [[0, 16, 104, 40, 80], [1, 8, 200, 60, 80]] with token_cost 1 attention_cost 0; "
            "this producer plans [[0, 1, 200, 60, 80]] with them",
        ),
        (  # one field differs
            [0.5, 0.002],
            [[0, 16, 104, 40, 80], [1, 8, 200, 61, 80]],
            "this producer plans [[0, 16, 104, 40, 80], [1, 8, 200, 60, 80]] with them",
        ),
        ([0.5, 0.002], _wire((0.5, 0.002), [16, 8])[:1], "this producer plans [[0, 1, 104, 40, 80], [1, 1, 200, 60"),
    ],
    ids=["none", "no-buckets", "no-costs", "other-shapes", "one-field", "fewer"],
)
def test_a_welcome_whose_plan_is_not_ours_is_refused_with_exit_78_and_one_line_naming_both(
    costs: list[float] | None, buckets: list[list[int]] | None, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    clock = FakeClock(100.0)
    s = _started(clock, FakePlanner())
    with caplog.at_level(logging.ERROR, logger="melfeed.producer.session"):
        s.on_message(_welcome(s, 7, costs, buckets), clock())
    assert s.exit_code == EXIT_CONFIG and why in s.reason
    assert s.joined_epoch is None and s.buckets is None and s.farewell() is None
    s.on_message(LeaseGrant(7, [Lease(0, 0, [1], 5.0)], 1), clock())
    assert s.next_build(clock()) is None  # nothing built for the refused consumer
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("refusing consumer epoch=7: its WELCOME") and why in line and "\n" not in line


def test_a_plan_this_producer_cannot_make_is_refused_with_exit_78_naming_the_setting() -> None:
    clock = FakeClock(100.0)
    err = ConfigError("is below the consumer's 300 rows", path=("buckets", "max_batch_size"), got=256)
    s = _started(clock, FakePlanner(err))
    s.on_message(_welcome(s, 7, [0.5, 0.002], _wire((0.5, 0.002), [300, 8])), clock())
    assert s.exit_code == EXIT_CONFIG and s.joined_epoch is None
    assert "this producer cannot: buckets.max_batch_size: is below the consumer's 300 rows, got 256" in s.reason
