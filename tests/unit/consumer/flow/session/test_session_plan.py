"""The consumer's handshake with a producer that learns the whole plan (``buckets.cost: measured``): its HELLO has no
buckets, every other field of the contract is still compared, and the WELCOME carries the consumer's shapes (rows
included) and the cost weights that planned them."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from melfeed.shared.wire.protocol import RejectCode, Welcome
from tests.unit.consumer.flow.session.session_rig import BUCKET, CONTRACT, EPOCH, A, B, Rig, err_codes, ids

MEASURED = dataclasses.replace(CONTRACT, costs=(0.5, 0.002))


def test_a_hello_without_buckets_is_welcomed_with_the_consumers_shapes_and_costs_and_leased_as_usual() -> None:
    rig = Rig(window=2, contract=MEASURED)
    welcome = rig.join(A, buckets=[], nonce=5)
    assert welcome == Welcome(EPOCH, 2, 1.0, False, 5, None, None, [0.5, 0.002], [BUCKET.as_wire()])
    assert welcome.buckets == CONTRACT.buckets and welcome.buckets is not CONTRACT.buckets  # a copy: ours stay ours
    assert ids(rig.grant()[A]) == [0, 1]
    [again] = rig.hello(A, buckets=[], nonce=5).sends  # a repeated HELLO: the same answer, leases kept
    assert again.msg == welcome and rig.session.stats().leases_outstanding == 2


def test_a_hello_naming_its_shapes_gets_no_plan_back() -> None:
    welcome = Rig(contract=MEASURED).join(A)
    assert welcome.costs is None and welcome.buckets is None and welcome.rows is None


def test_the_plan_goes_to_the_producer_that_asked_and_the_default_weights_are_sent_too() -> None:
    rig = Rig()
    assert rig.join(A, buckets=[]).costs == [1.0, 0.0]  # a consumer of the formula's defaults says so
    assert rig.join(B).costs is None


@pytest.mark.parametrize(
    ("field", "value"),
    [("fingerprint", "cd" * 32), ("n_mels", BUCKET.n_mels + 1), ("seed", 43), ("mel_dtype", "float16")],
)
def test_a_producer_learning_the_plan_is_still_refused_for_any_other_contract_difference(
    field: str, value: Any
) -> None:
    rig = Rig(contract=MEASURED)
    decision = rig.hello(A, buckets=[], **{field: value})
    assert err_codes(decision) == [RejectCode.CONTRACT]
    assert str(CONTRACT.buckets) not in decision.sends[0].msg.why  # type: ignore[union-attr]
    assert rig.session.stats().producers_alive == 0 and rig.grant() == {}
