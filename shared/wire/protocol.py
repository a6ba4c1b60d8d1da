"""Wire protocol between producers (DEALER) and the consumer (ROUTER).

Every message is a multipart ``[header]`` or ``[header, *payload]``: the header is one msgpack
map tagged by ``t`` (a ``MsgKind``); only BATCH carries payload frames, one raw frame per array in
``Bucket.shapes()`` order (``ARRAY_KEYS``, then the cache's extras: ``shared/wire/schema.py``) -- except on the
same-host shared-memory path: a producer whose HELLO offers
``CAP_SHM`` and whose WELCOME names an ``shm_dir`` gets leases naming a slot file, builds into it,
and sends a header-only BATCH naming that slot and generation. The payload is never inside msgpack (a ~100-byte header
packs in
microseconds; an 8 MB bin would be copied in and out again: docs/design.md).

Invariant: ``decode_header`` either returns a fully validated message dataclass or raises
``ProtocolError`` with a reject code; it never allocates more than the limits below, whatever
the peer declares (a 4 GB ``bin32`` is refused by the unpacker's ``max_bin_len``).
This is the only module that knows msgpack and the header layout; the message dataclasses themselves
are in ``shared/wire/messages.py`` (re-exported here).
"""

from __future__ import annotations

from typing import Any

import msgpack

from melfeed.shared.errors import MAX_REASON_CHARS, ProtocolError
from melfeed.shared.wire.layout import ARRAY_KEYS
from melfeed.shared.wire.messages import (
    CAP_SHM,
    FATAL_REJECTS,
    LEARN_ROWS,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    BatchHeader,
    Bye,
    Err,
    Heartbeat,
    Hello,
    Lease,
    LeaseGrant,
    Message,
    MsgKind,
    RejectCode,
    ShmSlot,
    StageCounters,
    Welcome,
)

__all__ = [
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "CAP_SHM",
    "LEARN_ROWS",
    "ShmSlot",
    "MsgKind",
    "RejectCode",
    "FATAL_REJECTS",
    "Hello",
    "Welcome",
    "LeaseGrant",
    "Lease",
    "BatchHeader",
    "Heartbeat",
    "StageCounters",
    "Err",
    "Bye",
    "Message",
    "encode",
    "decode_header",
    "max_producer_header_bytes",
]

_MAX_HEADER_BYTES = 1 << 20  # a LEASE for a window of 64 batches of 512 ids is ~300 kB
_MAX_STR = 4096
_MAX_ARRAY = 1 << 16
_MAX_MAP = 64
_MAX_BATCH_ARRAYS = 64  # base arrays + extras (+ their lengths) of one batch
_MAX_SHOWN_CODE_CHARS = 40  # of an unknown reject code in the error: longer than any known one
_MAX_ROWS = 2**31 - 1  # a WELCOME's rows: int32 on the consumer's side too (buckets.rows); the producer caps lower
_COST_RANGES = (("token_cost", 1000.0), ("attention_cost", 1.0))  # a WELCOME's costs: buckets.* bounds, from 0
_BUCKET_FIELDS = 5  # [index, B, T, L, n_mels] before the sequence extras' S


def encode(msg: Message) -> bytes:
    """Pack one header frame."""
    if isinstance(msg, Hello):
        d: dict[str, Any] = {
            "t": MsgKind.HELLO,
            "proto": msg.proto,
            "pid": msg.producer_id,
            "fp": msg.fingerprint,
            "buckets": msg.buckets,
            "n_mels": msg.n_mels,
            "seed": msg.seed,
            "nonce": msg.nonce,
            "mel": msg.mel_dtype,
        }
        if msg.caps:
            d["caps"] = msg.caps
    elif isinstance(msg, Welcome):
        d = {
            "t": MsgKind.WELCOME,
            "epoch": msg.epoch,
            "window": msg.window,
            "hb": msg.heartbeat_interval_s,
            "crc": msg.checksum,
            "nonce": msg.nonce,
        }
        if msg.shm_dir is not None:
            d["shm"] = msg.shm_dir
        if msg.rows is not None:
            d["rows"] = msg.rows
        if msg.costs is not None:
            d["costs"] = msg.costs
        if msg.buckets is not None:
            d["buckets"] = msg.buckets
    elif isinstance(msg, LeaseGrant):
        d = {
            "t": MsgKind.LEASE,
            "epoch": msg.epoch,
            "depth": msg.queue_depth,
            "leases": [_encode_lease(x) for x in msg.leases],
        }
    elif isinstance(msg, BatchHeader):
        d = {
            "t": MsgKind.BATCH,
            "epoch": msg.epoch,
            "id": msg.batch_id,
            "bucket": msg.bucket,
            "shapes": msg.shapes,
            "dtypes": msg.dtypes,
            "crc": msg.crc32,
            "q": msg.quarantined,
        }
        if msg.shm is not None:
            d["slot"], d["gen"] = msg.shm
        if msg.quarantine_note:
            d["qr"] = msg.quarantine_note[:MAX_REASON_CHARS]
    elif isinstance(msg, Heartbeat):
        d = {"t": MsgKind.HB, "epoch": msg.epoch, "depth": msg.queue_depth, "applied": msg.applied}
        if msg.stats is not None:
            st = msg.stats
            d["st"] = [st.batches, st.read_s, st.assemble_s, st.send_s]
        if msg.done:
            d["done"] = True
    elif isinstance(msg, Err):
        d = {"t": MsgKind.ERR, "code": msg.code, "why": msg.why[:MAX_REASON_CHARS]}
    elif isinstance(msg, Bye):
        d = {"t": MsgKind.BYE, "epoch": msg.epoch}
        if msg.exit_code or msg.reason:
            d["code"], d["why"] = msg.exit_code, msg.reason[:MAX_REASON_CHARS]
    else:
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    return msgpack.packb(d, use_bin_type=True)  # type: ignore[no-any-return]


def _encode_lease(x: Lease) -> list[Any]:
    item: list[Any] = [x.batch_id, x.bucket, x.sample_ids, x.deadline_s]
    if x.shm is not None:
        item += [x.shm.name, x.shm.slot, x.shm.generation]
    return item


def max_producer_header_bytes(max_batch_size: int) -> int:
    """Bound on a legal producer->consumer header (HELLO, BATCH, HB, BYE), in bytes.

    The largest is a BATCH whose ``q`` lists every row (<= 9 bytes per id) or a HELLO with two
    maximal strings; both stay far below this. The consumer decodes with this limit, not with
    the general 1 MiB one: decoding costs ~150 ns per byte of nested lists, so a 1 MB header
    would hold the receiver thread ~150 ms per message -- too slow for the flood detector to
    ever count 200 in its window -- and stall every good producer for as long as it is sent.
    """
    return (16 << 10) + 9 * max_batch_size


def _unpack(raw: bytes, max_bytes: int) -> dict[str, Any]:
    if len(raw) > max_bytes:
        raise ProtocolError(RejectCode.DECODE, f"header of {len(raw)} bytes exceeds {max_bytes}")
    try:
        obj = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=_MAX_STR,
            max_bin_len=_MAX_STR,
            max_array_len=_MAX_ARRAY,
            max_map_len=_MAX_MAP,
            max_ext_len=0,
        )
    except msgpack.ExtraData as err:
        raise ProtocolError(RejectCode.DECODE, "trailing bytes after the header") from err
    except (ValueError, msgpack.UnpackException, TypeError, RecursionError) as err:
        # FormatError, StackError, "incomplete input" and limit violations are all ValueError.
        raise ProtocolError(RejectCode.DECODE, f"undecodable header: {type(err).__name__}: {err}") from err
    if not isinstance(obj, dict):
        raise ProtocolError(RejectCode.SCHEMA, f"header is a {type(obj).__name__}, not a map")
    return obj


def _get(d: dict[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in d:
        raise ProtocolError(RejectCode.SCHEMA, f"missing key {key!r}")
    v = d[key]
    if isinstance(v, bool) and kind is not bool and bool not in (kind if isinstance(kind, tuple) else ()):
        raise ProtocolError(RejectCode.SCHEMA, f"key {key!r} has type bool")
    if not isinstance(v, kind):
        raise ProtocolError(RejectCode.SCHEMA, f"key {key!r} has type {type(v).__name__}")
    return v


def _count(d: dict[str, Any], key: str) -> int:
    """An id, index or epoch: a non-negative integer (a negative batch id would pass for an old one)."""
    v: int = _get(d, key, int)
    if v < 0:
        raise ProtocolError(RejectCode.SCHEMA, f"key {key!r} is negative")
    return v


def _int_list(v: Any, key: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ProtocolError(RejectCode.SCHEMA, f"key {key!r} must be a list of integers")
    return v


def _rows(d: dict[str, Any]) -> list[int] | None:
    """A WELCOME's optional ``rows``: a non-empty list of row counts, each 1..2**31-1 (the producer checks the
    length and its own cap)."""
    if "rows" not in d:
        return None
    rows = _int_list(d["rows"], "rows")
    if not rows or not all(1 <= r <= _MAX_ROWS for r in rows):
        raise ProtocolError(RejectCode.SCHEMA, f"key 'rows' must list row counts 1..{_MAX_ROWS}, one per bucket")
    return rows


def _costs(d: dict[str, Any]) -> list[float] | None:
    """A WELCOME's optional ``costs``: [token_cost, attention_cost], finite, in the ranges ``buckets.*`` allows."""
    if "costs" not in d:
        return None
    costs = d["costs"]
    if not isinstance(costs, list) or len(costs) != len(_COST_RANGES):
        raise ProtocolError(RejectCode.SCHEMA, "key 'costs' must be [token_cost, attention_cost]")
    for v, (name, top) in zip(costs, _COST_RANGES):  # inf and nan fail the range test too
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= top:
            raise ProtocolError(RejectCode.SCHEMA, f"key 'costs': {name} must be a number in 0..{top:g}")
    return [float(v) for v in costs]


def _plan_buckets(d: dict[str, Any]) -> list[list[int]] | None:
    """A WELCOME's optional ``buckets``: a non-empty list of ``[index, B, T, L, n_mels, *S]`` in index order, every
    field but the index 1..2**31-1 (the producer compares them with its own plan)."""
    if "buckets" not in d:
        return None
    buckets = d["buckets"]
    shape = f"key 'buckets' must list [index, B, T, L, n_mels, *S] in index order, each size 1..{_MAX_ROWS}"
    if not isinstance(buckets, list) or not buckets:
        raise ProtocolError(RejectCode.SCHEMA, shape)
    for k, b in enumerate(buckets):
        b = _int_list(b, "buckets")
        if (
            not _BUCKET_FIELDS <= len(b) <= _BUCKET_FIELDS + _MAX_BATCH_ARRAYS
            or b[0] != k
            or not all(1 <= v <= _MAX_ROWS for v in b[1:])
        ):
            raise ProtocolError(RejectCode.SCHEMA, shape)
    return buckets


def _opt_int(d: dict[str, Any], key: str) -> int:
    return _get(d, key, int) if key in d else 0


def _decode_lease(item: Any) -> Lease:
    if not isinstance(item, list) or len(item) not in (4, 7):
        raise ProtocolError(
            RejectCode.SCHEMA,
            "lease must be [batch_id, bucket, sample_ids, deadline_s] (+ [shm file, slot, generation])",
        )
    bid, bucket, ids, deadline = item[:4]
    if not isinstance(bid, int) or not isinstance(bucket, int) or not isinstance(deadline, (int, float)):
        raise ProtocolError(RejectCode.SCHEMA, "lease fields have wrong types")
    shm = None
    if len(item) == 7:
        name, slot, gen = item[4:]
        if (
            not isinstance(name, str)
            or "/" in name
            or name in ("", ".", "..")
            or not isinstance(slot, int)
            or not isinstance(gen, int)
            or slot < 0
            or gen < 0
        ):
            raise ProtocolError(RejectCode.SCHEMA, "lease shm fields must be [bare file name, slot, generation]")
        shm = ShmSlot(name, slot, gen)
    return Lease(bid, bucket, _int_list(ids, "sample_ids"), float(deadline), shm)


def _decode_stats(item: Any) -> StageCounters | None:
    """The optional ``st`` of a heartbeat: a count and three finite, non-negative times."""
    if item is None:
        return None
    if not isinstance(item, list) or len(item) != 4:
        raise ProtocolError(RejectCode.SCHEMA, "st must be [batches, read_s, assemble_s, send_s]")
    n, *times = item
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ProtocolError(RejectCode.SCHEMA, "st batches must be a non-negative integer")
    for v in times:  # inf and nan fail the range test too
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1e12:
            raise ProtocolError(RejectCode.SCHEMA, "st times must be finite non-negative numbers")
    return StageCounters(n, float(times[0]), float(times[1]), float(times[2]))


def _reject_code(code: str) -> RejectCode:
    if code not in RejectCode._value2member_map_:
        raise ProtocolError(RejectCode.SCHEMA, f"unknown reject code {code[:_MAX_SHOWN_CODE_CHARS]!r}")
    return RejectCode(code)


def decode_header(raw: bytes, max_bytes: int = _MAX_HEADER_BYTES) -> Message:
    """Decode and validate one header frame.

    Args:
        raw: the header frame.
        max_bytes: longest header accepted; checked before unpacking (see
            ``max_producer_header_bytes`` for the consumer's tighter bound).

    Raises:
        ProtocolError: code DECODE (not msgpack, truncated, trailing bytes, limits), SCHEMA
            (missing or mistyped key, no ``t``, an ERR's unknown reject code) or TYPE (unknown kind).
    """
    d = _unpack(raw, max_bytes)
    if "t" not in d:
        raise ProtocolError(RejectCode.SCHEMA, "map has no 't' (message kind)")
    t = d["t"]
    if not isinstance(t, int) or isinstance(t, bool) or t not in MsgKind._value2member_map_:
        raise ProtocolError(RejectCode.TYPE, f"unknown message kind {t!r}")
    kind = MsgKind(t)
    if kind is MsgKind.HELLO:
        buckets = _get(d, "buckets", list)
        if not all(isinstance(b, list) for b in buckets):
            raise ProtocolError(RejectCode.SCHEMA, "buckets must be a list of lists")
        caps = _get(d, "caps", list) if "caps" in d else []
        if not all(isinstance(c, str) for c in caps):
            raise ProtocolError(RejectCode.SCHEMA, "caps must be a list of strings")
        return Hello(
            _get(d, "proto", int),
            _get(d, "pid", str),
            _get(d, "fp", str),
            [_int_list(b, "buckets") for b in buckets],
            _get(d, "n_mels", int),
            _get(d, "seed", int),
            _count(d, "nonce"),
            caps,
            _get(d, "mel", str),
        )
    if kind is MsgKind.WELCOME:
        return Welcome(
            _get(d, "epoch", int),
            _get(d, "window", int),
            float(_get(d, "hb", (int, float))),
            bool(_get(d, "crc", bool)),
            _count(d, "nonce"),
            _get(d, "shm", str) if "shm" in d else None,
            _rows(d),
            _costs(d),
            _plan_buckets(d),
        )
    if kind is MsgKind.LEASE:
        leases = [_decode_lease(x) for x in _get(d, "leases", list)]
        return LeaseGrant(_get(d, "epoch", int), leases, _get(d, "depth", int))
    if kind is MsgKind.BATCH:
        shapes = _get(d, "shapes", list)
        dtypes = _get(d, "dtypes", list)
        if len(shapes) != len(dtypes) or not len(ARRAY_KEYS) <= len(shapes) <= _MAX_BATCH_ARRAYS:
            raise ProtocolError(
                RejectCode.SCHEMA, f"shapes and dtypes must list the same {len(ARRAY_KEYS)}..{_MAX_BATCH_ARRAYS} arrays"
            )
        if not all(isinstance(x, str) for x in dtypes):
            raise ProtocolError(RejectCode.SCHEMA, "dtypes must be strings")
        crc = d.get("crc")
        if crc is not None and (not isinstance(crc, int) or isinstance(crc, bool)):
            raise ProtocolError(RejectCode.SCHEMA, "crc must be an integer or null")
        shm = (_count(d, "slot"), _count(d, "gen")) if "slot" in d or "gen" in d else None
        return BatchHeader(
            _count(d, "epoch"),
            _count(d, "id"),
            _count(d, "bucket"),
            [_int_list(s, "shapes") for s in shapes],
            dtypes,
            crc,
            _int_list(d.get("q", []), "q"),
            shm,
            _get(d, "qr", str)[:MAX_REASON_CHARS] if "qr" in d else "",
        )
    if kind is MsgKind.HB:
        return Heartbeat(
            _count(d, "epoch"),
            _opt_int(d, "depth"),
            _opt_int(d, "applied"),
            _decode_stats(d.get("st")),
            _get(d, "done", bool) if "done" in d else False,
        )
    if kind is MsgKind.ERR:
        return Err(_reject_code(_get(d, "code", str)), _get(d, "why", str))
    return Bye(_count(d, "epoch"), _opt_int(d, "code"), _get(d, "why", str) if "why" in d else "")
