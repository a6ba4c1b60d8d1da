"""The consumer's handshake with a producer that learns its rows (``buckets.batch_size: auto`` without rows): every
other field of the contract is still compared, and the WELCOME carries the consumer's rows."""

from __future__ import annotations

import pytest

from melfeed.shared.wire.protocol import LEARN_ROWS, RejectCode, Welcome
from tests.unit.consumer.flow.session.session_rig import BUCKET, CONTRACT, EPOCH, A, Rig, err_codes, ids

LEARNING = [[0, LEARN_ROWS, *BUCKET.as_wire()[2:]]]  # [index, B, T, L, n_mels]: all but B as the consumer's


def test_a_hello_asking_for_rows_is_welcomed_with_the_consumers_and_leased_as_usual() -> None:
    rig = Rig(window=2)
    welcome = rig.join(A, buckets=LEARNING, nonce=5)
    assert welcome == Welcome(EPOCH, 2, 1.0, False, 5, None, [BUCKET.batch_size])
    assert ids(rig.grant()[A]) == [0, 1]
    [again] = rig.hello(A, buckets=LEARNING, nonce=5).sends  # a repeated HELLO: the same answer, leases kept
    assert again.msg == welcome and rig.session.stats().leases_outstanding == 2


def test_a_hello_naming_its_rows_gets_no_rows_back() -> None:
    assert Rig().join(A).rows is None


@pytest.mark.parametrize(
    "buckets",
    [
        [[0, BUCKET.batch_size + 1, *BUCKET.as_wire()[2:]]],  # explicit rows that differ: refused, as ever
        [[0, LEARN_ROWS, BUCKET.max_frames * 2, *BUCKET.as_wire()[3:]]],  # another T
        [[0, LEARN_ROWS, BUCKET.max_frames, BUCKET.max_tokens + 1, BUCKET.n_mels]],  # another L
        [[0, LEARN_ROWS, BUCKET.max_frames, BUCKET.max_tokens, BUCKET.n_mels + 1]],  # another n_mels
        [[0, LEARN_ROWS, *BUCKET.as_wire()[2:], 7]],  # a sequence length the consumer has not
        [[1, LEARN_ROWS, *BUCKET.as_wire()[2:]]],  # another index
        LEARNING + [[1, LEARN_ROWS, *BUCKET.as_wire()[2:]]],  # another bucket count
        [[0, LEARN_ROWS]],
        [[0]],
    ],
    ids=["rows", "T", "L", "n_mels", "S", "index", "count", "short", "shorter"],
)
def test_asking_for_rows_never_skips_the_rest_of_the_shape_contract(buckets: list[list[int]]) -> None:
    rig = Rig()
    decision = rig.hello(A, buckets=buckets)
    assert err_codes(decision) == [RejectCode.CONTRACT]
    assert "bucket shapes differ" in decision.sends[0].msg.why  # type: ignore[union-attr]
    assert rig.session.stats().producers_alive == 0 and rig.grant() == {}


def test_a_producer_asking_for_rows_is_still_refused_for_another_dataset() -> None:
    decision = Rig().hello(A, buckets=LEARNING, fingerprint="cd" * 32)
    assert err_codes(decision) == [RejectCode.CONTRACT]
    assert str(CONTRACT.buckets) not in decision.sends[0].msg.why  # type: ignore[union-attr]
