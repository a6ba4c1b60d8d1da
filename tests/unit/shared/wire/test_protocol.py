"""Wire protocol: round trips and rejection codes for malformed headers (B1-B4, B13)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from melfeed.shared.errors import ProtocolError
from melfeed.shared.wire.protocol import (
    CAP_SHM,
    LEARN_ROWS,
    BatchHeader,
    Bye,
    Err,
    Heartbeat,
    Hello,
    Lease,
    LeaseGrant,
    MsgKind,
    RejectCode,
    ShmSlot,
    StageCounters,
    Welcome,
    decode_header,
    encode,
)

MESSAGES = [
    Hello(1, "producer-1", "abcd", [[0, 32, 440, 106, 80]], 80, 7, 41),
    Welcome(123, 2, 0.5, True, 41),
    LeaseGrant(123, [Lease(5, 1, [3, 9, 11], 30.0)], 4),
    BatchHeader(123, 5, 1, [[32, 440, 80], [32], [32, 106], [32]], ["float32", "int32", "int32", "int32"], 77, [3]),
    BatchHeader(123, 6, 0, [[1, 2, 3], [1], [1, 2], [1]], ["float32", "int32", "int32", "int32"], None, []),
    Hello(1, "producer-2", "abcd", [[0, 32, 440, 106, 80]], 80, 7, 0, [CAP_SHM]),
    Hello(1, "producer-3", "abcd", [[0, 32, 440, 106, 80]], 80, 7, 3, [CAP_SHM], mel_dtype="float16"),
    Welcome(123, 2, 0.5, False, 0, "/run/melfeed"),
    LeaseGrant(123, [Lease(5, 1, [3, 9], 30.0, ShmSlot("melfeed-9-123-s2-g4", 2, 4)), Lease(6, 0, [1], 30.0)], 4),
    BatchHeader(123, 5, 1, [[1, 2, 3], [1], [1, 2], [1]], ["float32", "int32", "int32", "int32"], 5, [], (2, 4)),
    BatchHeader(
        123,
        7,
        0,
        [[1, 2, 3], [1], [1, 2], [1]],
        ["float32", "int32", "int32", "int32"],
        None,
        [4, 9],
        None,
        "/cache/mels/LJ001-0004.npy: missing",
    ),
    Heartbeat(123, 4, 99),
    Heartbeat(123, 0, 0, StageCounters(60, 0.072, 0.018, 0.024)),
    Heartbeat(123, 0, 150, done=True),
    Err(RejectCode.LEASE, "batch 7 is not leased"),
    Bye(123),
    Hello(1, "producer-3", "abcd", [[0, 32, 440, 106, 80]], 80, 7, 2**64 - 1, [CAP_SHM]),
    Welcome(123, 2, 0.5, False, 2**64 - 1),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: object) -> None:
    assert decode_header(encode(msg)) == msg  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"\xc1garbage", RejectCode.DECODE),  # B1 reserved byte
        (encode(Bye(1))[:-1], RejectCode.DECODE),  # B2 truncated
        (encode(Bye(1)) + encode(Bye(1)), RejectCode.DECODE),  # B3 two objects
        (b"\xdb\xff\xff\xff\xff", RejectCode.DECODE),  # B4 4 GB str32 declared
        (b"\xc6\xff\xff\xff\xff", RejectCode.DECODE),  # B4 4 GB bin32 declared
        (b"\x91" * 5000 + b"\xc0", RejectCode.DECODE),  # B4 deep nesting
        (msgpack.packb([1, 2, 3]), RejectCode.SCHEMA),  # not a map
        (msgpack.packb({"epoch": 1}), RejectCode.SCHEMA),  # B13 map without t
        (msgpack.packb({"t": 99}), RejectCode.TYPE),  # B13 unknown kind
        (msgpack.packb({"t": "x"}), RejectCode.TYPE),
        (msgpack.packb({"t": int(MsgKind.HB), "epoch": "one"}), RejectCode.SCHEMA),
        (msgpack.packb({"t": int(MsgKind.HB), "epoch": 1, "depth": "x"}), RejectCode.SCHEMA),
        (
            msgpack.packb(
                {"t": int(MsgKind.BATCH), "epoch": 1, "id": 1, "bucket": 0, "shapes": [[1]], "dtypes": ["float32"]}
            ),
            RejectCode.SCHEMA,
        ),
        (
            msgpack.packb(
                {
                    "t": int(MsgKind.HELLO),
                    "proto": 1,
                    "pid": "p",
                    "fp": "f",
                    "buckets": [[1, "x"]],
                    "n_mels": 80,
                    "seed": 0,
                }
            ),
            RejectCode.SCHEMA,
        ),
        (msgpack.packb({"t": int(MsgKind.LEASE), "epoch": 1, "depth": 0, "leases": [[1, 2]]}), RejectCode.SCHEMA),
        (
            msgpack.packb(
                {"t": int(MsgKind.LEASE), "epoch": 1, "depth": 0, "leases": [[1, 0, [1], 1.0, "../etc/passwd", 0, 0]]}
            ),
            RejectCode.SCHEMA,
        ),  # not a bare name
        (
            msgpack.packb({"t": int(MsgKind.LEASE), "epoch": 1, "depth": 0, "leases": [[1, 0, [1], 1.0, "f", -1, 0]]}),
            RejectCode.SCHEMA,
        ),
        (
            msgpack.packb(
                {
                    "t": int(MsgKind.BATCH),
                    "epoch": 1,
                    "id": 1,
                    "bucket": 0,
                    "shapes": [[1]] * 4,
                    "dtypes": ["float32"] * 4,
                    "slot": 1,
                }
            ),
            RejectCode.SCHEMA,
        ),  # slot without gen
        (
            msgpack.packb(
                {
                    "t": int(MsgKind.HELLO),
                    "proto": 1,
                    "pid": "p",
                    "fp": "f",
                    "buckets": [],
                    "n_mels": 80,
                    "seed": 0,
                    "caps": [1],
                }
            ),
            RejectCode.SCHEMA,
        ),
        (b"", RejectCode.DECODE),
    ],
)
def test_malformed_headers_are_rejected_with_a_code(raw: bytes, code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_header(raw)
    assert info.value.code == code
    assert len(info.value.why) <= 200


def test_oversized_header_is_refused_before_unpacking() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_header(b"\x80" + b"\x00" * (2 << 20))
    assert info.value.code == RejectCode.DECODE


def test_bool_is_not_accepted_as_an_integer_field() -> None:
    with pytest.raises(ProtocolError):
        decode_header(msgpack.packb({"t": int(MsgKind.BYE), "epoch": True}))


def test_a_heartbeat_of_only_its_epoch_is_accepted_with_zero_depths_and_no_stats() -> None:
    raw = msgpack.packb({"t": int(MsgKind.HB), "epoch": 7})
    assert decode_header(raw) == Heartbeat(7, 0, 0, None)


def test_heartbeat_stats_travel_as_four_numbers() -> None:
    raw = encode(Heartbeat(7, stats=StageCounters(3, 1, 0.5, 0.25)))
    assert msgpack.unpackb(raw)["st"] == [3, 1, 0.5, 0.25]
    assert decode_header(raw).stats == StageCounters(3, 1.0, 0.5, 0.25)  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "stats",
    [
        "fast",
        [1, 0.1, 0.1],
        [1, 0.1, 0.1, 0.1, 0.1],
        [-1, 0.0, 0.0, 0.0],
        [True, 0.0, 0.0, 0.0],
        [1.5, 0.0, 0.0, 0.0],
        [1, -0.1, 0.0, 0.0],
        [1, 0.0, float("nan"), 0.0],
        [1, 0.0, 0.0, float("inf")],
        [1, "0", 0.0, 0.0],
        [1, 0.0, False, 0.0],
        {"batches": 1},
    ],
)
def test_malformed_heartbeat_stats_are_rejected(stats: object) -> None:
    raw = msgpack.packb({"t": int(MsgKind.HB), "epoch": 7, "st": stats})
    with pytest.raises(ProtocolError) as info:
        decode_header(raw)
    assert info.value.code == RejectCode.SCHEMA


def test_plan_end_is_a_heartbeat_field_sent_only_when_true() -> None:
    assert "done" not in msgpack.unpackb(encode(Heartbeat(7, 1, 2)))
    raw = encode(Heartbeat(7, 0, 150, done=True))
    assert msgpack.unpackb(raw)["done"] is True
    assert decode_header(raw) == Heartbeat(7, 0, 150, None, True)


def test_every_reject_code_is_its_own_string_on_the_wire_and_decodes_to_the_member() -> None:
    for code in RejectCode:
        raw = encode(Err(code, "why"))
        assert msgpack.unpackb(raw)["code"] == code.value == str(code) == f"{code}" == code.name
        assert decode_header(raw) == Err(code, "why") and decode_header(raw).code is code  # type: ignore[union-attr]


@pytest.mark.parametrize("code", ["X", "lease", "", "LEASE\n" * 50])
def test_an_err_with_an_unknown_reject_code_is_refused_as_malformed(code: str) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_header(msgpack.packb({"t": int(MsgKind.ERR), "code": code, "why": "y"}))
    assert info.value.code == RejectCode.SCHEMA and "unknown reject code" in info.value.why
    assert "\n" not in str(info.value) and len(info.value.why) < 80


@pytest.mark.parametrize("done", [1, 0, "yes", None, [True]])
def test_plan_end_flag_must_be_a_boolean(done: object) -> None:
    raw = msgpack.packb({"t": int(MsgKind.HB), "epoch": 7, "done": done})
    with pytest.raises(ProtocolError) as info:
        decode_header(raw)
    assert info.value.code == RejectCode.SCHEMA


@pytest.mark.parametrize(
    ("msg", "key", "value"),
    [
        (Hello(1, "p", "f", [], 80, 0, 5), "nonce", 5),
        (Hello(1, "p", "f", [], 80, 0, 5), "mel", "float32"),
        (Welcome(7, 2, 0.5, False, 5), "nonce", 5),
    ],
    ids=["HELLO-nonce", "HELLO-mel", "WELCOME-nonce"],
)
def test_a_hello_or_welcome_always_carries_its_join_nonce_and_mel_dtype_and_is_malformed_without(
    msg: Hello | Welcome, key: str, value: object
) -> None:
    raw = msgpack.unpackb(encode(msg))
    assert raw[key] == value
    with pytest.raises(ProtocolError) as info:
        decode_header(msgpack.packb({k: v for k, v in raw.items() if k != key}))
    assert info.value.code == RejectCode.SCHEMA and info.value.why == f"missing key {key!r}"


@pytest.mark.parametrize("nonce", [-1, "n", 1.5, True, None, [1]])
@pytest.mark.parametrize("kind", [MsgKind.HELLO, MsgKind.WELCOME])
def test_a_nonce_must_be_a_non_negative_integer(kind: MsgKind, nonce: object) -> None:
    base = (
        msgpack.unpackb(encode(Hello(1, "p", "f", [], 80, 0, 1)))
        if kind is MsgKind.HELLO
        else msgpack.unpackb(encode(Welcome(7, 2, 0.5, False, 1)))
    )
    with pytest.raises(ProtocolError) as info:
        decode_header(msgpack.packb({**base, "nonce": nonce}))
    assert info.value.code == RejectCode.SCHEMA


def test_the_quarantine_note_is_on_the_wire_only_with_quarantined_rows_and_cut_to_one_reason() -> None:
    shapes, dtypes = [[1, 2, 3], [1], [1, 2], [1]], ["float32", "int32", "int32", "int32"]
    plain = BatchHeader(1, 2, 0, shapes, dtypes, None, [])
    assert "qr" not in msgpack.unpackb(encode(plain))
    assert decode_header(encode(plain)).quarantine_note == ""  # type: ignore[union-attr]
    long = BatchHeader(1, 2, 0, shapes, dtypes, None, [5], None, "x" * 500)
    assert decode_header(encode(long)).quarantine_note == "x" * 200  # type: ignore[union-attr]
    raw = msgpack.unpackb(encode(plain))
    with pytest.raises(ProtocolError) as info:
        decode_header(msgpack.packb({**raw, "qr": 7}))
    assert info.value.code == RejectCode.SCHEMA
    assert decode_header(msgpack.packb({**raw, "qr": "y" * 300})).quarantine_note == "y" * 200  # type: ignore[union-attr]


def test_learned_rows_travel_as_a_zero_row_count_in_hello_and_a_rows_list_in_welcome() -> None:
    hello = Hello(1, "p", "f", [[0, LEARN_ROWS, 440, 106, 80], [1, LEARN_ROWS, 880, 200, 80]], 80, 7, 3)
    assert decode_header(encode(hello)) == hello
    welcome = Welcome(7, 2, 0.5, False, 3, None, [16, 8])
    assert msgpack.unpackb(encode(welcome))["rows"] == [16, 8] and decode_header(encode(welcome)) == welcome
    assert "rows" not in msgpack.unpackb(encode(Welcome(7, 2, 0.5, False, 3)))  # not asked for: not sent
    assert decode_header(encode(Welcome(7, 2, 0.5, False, 3))).rows is None  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "rows", [[], [0], [8, -1], [2**31], "8", 8, [8.0], [True], ["8"], None, [[8]], {"0": 8}], ids=repr
)
def test_a_welcome_with_rows_of_the_wrong_type_or_range_is_refused_as_malformed(rows: object) -> None:
    raw = msgpack.unpackb(encode(Welcome(7, 2, 0.5, False, 3)))
    with pytest.raises(ProtocolError) as info:
        decode_header(msgpack.packb({**raw, "rows": rows}))
    assert info.value.code == RejectCode.SCHEMA and "rows" in info.value.why


PLAN = [[0, 16, 440, 106, 80], [1, 8, 880, 200, 80, 12]]  # [index, B, T, L, n_mels, *S]


def test_a_learned_plan_travels_as_a_hello_without_buckets_and_a_welcome_with_costs_and_buckets() -> None:
    hello = Hello(1, "p", "f", [], 80, 7, 3)
    assert hello.learns_plan and not Hello(1, "p", "f", [[0, 32, 440, 106, 80]], 80, 7, 3).learns_plan
    assert msgpack.unpackb(encode(hello))["buckets"] == [] and decode_header(encode(hello)) == hello
    welcome = Welcome(7, 2, 0.5, False, 3, None, None, [0.5, 0.002], PLAN)
    raw = msgpack.unpackb(encode(welcome))
    assert (raw["costs"], raw["buckets"]) == ([0.5, 0.002], PLAN) and decode_header(encode(welcome)) == welcome
    assert decode_header(msgpack.packb({**raw, "costs": [1, 0]})).costs == [1.0, 0.0]  # type: ignore[union-attr]
    assert not {"costs", "buckets"} & set(msgpack.unpackb(encode(Welcome(7, 2, 0.5, False, 3))))  # not asked for
    plain = decode_header(encode(Welcome(7, 2, 0.5, False, 3)))
    assert isinstance(plain, Welcome) and plain.costs is None and plain.buckets is None


@pytest.mark.parametrize(
    "costs",
    [
        [0.5],
        [0.5, 0.002, 1.0],
        [],
        "0.5",
        0.5,
        None,
        [-0.1, 0.0],
        [1000.5, 0.0],
        [0.5, 1.5],
        [0.5, -1e-9],
        [float("nan"), 0.0],
        [float("inf"), 0.0],
        [0.5, float("nan")],
        [True, 0.0],
        ["0.5", 0.0],
        [[0.5], 0.0],
    ],
    ids=repr,
)
def test_a_welcome_with_costs_of_the_wrong_type_length_or_range_is_refused_as_malformed(costs: object) -> None:
    raw = msgpack.unpackb(encode(Welcome(7, 2, 0.5, False, 3, None, None, [0.5, 0.002], PLAN)))
    with pytest.raises(ProtocolError) as info:
        decode_header(msgpack.packb({**raw, "costs": costs}))
    assert info.value.code == RejectCode.SCHEMA and "costs" in info.value.why


@pytest.mark.parametrize(
    "buckets",
    [
        [],
        "x",
        None,
        [[0, 16, 440, 106]],  # no n_mels
        [[1, 16, 440, 106, 80]],  # index not its position
        [[0, 16, 440, 106, 80], [0, 8, 880, 200, 80]],
        [[0, 0, 440, 106, 80]],  # no rows
        [[0, 16, -440, 106, 80]],
        [[0, 16, 440, 2**31, 80]],
        [[0, 16, 440, 106, 80, 0]],  # a sequence length of 0
        [[0, 16, 440, 106, 80, *[1] * 65]],  # more sequence lengths than a batch has arrays
        [[0, 16.0, 440, 106, 80]],
        [[0, True, 440, 106, 80]],
        [[0, "16", 440, 106, 80]],
        [16, 440],
    ],
    ids=repr,
)
def test_a_welcome_with_buckets_of_the_wrong_type_length_or_range_is_refused_as_malformed(buckets: object) -> None:
    raw = msgpack.unpackb(encode(Welcome(7, 2, 0.5, False, 3, None, None, [0.5, 0.002], PLAN)))
    with pytest.raises(ProtocolError) as info:
        decode_header(msgpack.packb({**raw, "buckets": buckets}))
    assert info.value.code == RejectCode.SCHEMA and "buckets" in info.value.why


_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=6),
    max_leaves=24,
)


@settings(max_examples=100, deadline=None)
@given(
    costs=_VALUES | st.lists(st.floats(-1.0, 1001.0) | st.integers(-1, 1001), min_size=2, max_size=2),
    buckets=_VALUES | st.lists(st.lists(st.integers(-1, 2), min_size=5, max_size=6), min_size=1, max_size=2),
)
def test_any_costs_and_buckets_in_a_welcome_decode_to_a_valid_plan_or_a_schema_refusal(
    costs: object, buckets: object
) -> None:
    raw = msgpack.unpackb(encode(Welcome(7, 2, 0.5, False, 3)))
    try:
        msg = decode_header(msgpack.packb({**raw, "costs": costs, "buckets": buckets}))
    except ProtocolError as err:
        assert err.code == RejectCode.SCHEMA
        return
    assert isinstance(msg, Welcome) and msg.costs is not None and msg.buckets is not None
    token_cost, attention_cost = msg.costs
    assert 0.0 <= token_cost <= 1000.0 and 0.0 <= attention_cost <= 1.0
    assert msg.buckets and all(b[0] == k and len(b) >= 5 and min(b[1:]) >= 1 for k, b in enumerate(msg.buckets))
