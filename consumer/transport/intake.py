"""Checks a BATCH against its lease and takes its payload into the lease's ring slot.

Two paths, one set of checks (docs/design.md, invariant 7): the header's bucket, shapes and dtypes must be the
planned ones (SHAPE/DTYPE), then either the four payload frames are received with ``recv_into``
straight into the slot (ZeroMQ payload path) or, on the shared-memory path, the producer already
built the batch in the slot and the header must come alone (FRAMES otherwise). Either way the
crc32 (when checksums are on) and the lengths (mel_len, tok_len and each sequence extra's
``<name>_len``) are checked in the slot before it is marked ready. The arrays are the bucket's
(``Bucket.shapes()``: the base arrays, then the cache's extras), so the schema is the manifest's.
Pure functions of the socket's current message; the receiver thread calls them and owns the socket.
"""

from __future__ import annotations

import zlib

import numpy as np
import numpy.typing as npt
import zmq

from melfeed.shared.errors import ProtocolError
from melfeed.shared.wire.buckets import Bucket, BucketSet
from melfeed.shared.wire.protocol import BatchHeader, RejectCode

__all__ = ["check_header", "fill_from_frames", "check_in_place", "check_lengths", "check_extra_lengths"]

Views = dict[str, npt.NDArray[np.generic]]


def check_header(hdr: BatchHeader, planned_bucket: int, buckets: BucketSet) -> Bucket:
    """The bucket the plan says ``hdr.batch_id`` has, after checking the header's shapes and dtypes."""
    expected = buckets.buckets[planned_bucket]
    if hdr.bucket != planned_bucket or hdr.shapes != [list(s) for s in expected.shapes().values()]:
        raise ProtocolError(
            RejectCode.SHAPE,
            f"batch {hdr.batch_id}: shapes {hdr.shapes} do not match "
            f"bucket {planned_bucket} {list(expected.shapes().values())}",
        )
    if hdr.dtypes != list(expected.dtypes().values()):
        raise ProtocolError(RejectCode.DTYPE, f"batch {hdr.batch_id}: dtypes {hdr.dtypes} not allowed")
    return expected


def fill_from_frames(sock: zmq.Socket[bytes], views: Views, hdr: BatchHeader, expected: Bucket, checksum: bool) -> int:
    """Receive the payload frames into ``views`` (a payload lease's slot); returns the bytes taken."""
    if hdr.shm is not None:
        raise ProtocolError(RejectCode.FRAMES, f"batch {hdr.batch_id}: header-only BATCH on a payload lease")
    crc = 0
    n_bytes = 0
    for key in views:  # layout order = the header's order (check_header)
        if not sock.getsockopt(zmq.RCVMORE):
            raise ProtocolError(RejectCode.FRAMES, f"batch {hdr.batch_id}: missing frame {key!r}")
        buf = views[key].data.cast("B")
        n = sock.recv_into(buf)
        if n != buf.nbytes:
            raise ProtocolError(
                RejectCode.SHAPE, f"batch {hdr.batch_id}: frame {key!r} has {n} bytes, expected {buf.nbytes}"
            )
        if hdr.crc32 is not None:
            crc = zlib.crc32(buf, crc)
        n_bytes += n
    if sock.getsockopt(zmq.RCVMORE):
        raise ProtocolError(RejectCode.FRAMES, f"batch {hdr.batch_id}: extra frames")
    _check_crc(hdr, crc, checksum)
    check_lengths(views, expected.max_frames, expected.max_tokens, hdr.batch_id)
    check_extra_lengths(views, expected, hdr.batch_id)
    return n_bytes


def check_in_place(sock: zmq.Socket[bytes], views: Views, hdr: BatchHeader, expected: Bucket, checksum: bool) -> None:
    """Check a batch the producer built in a shared-memory slot; the header must come alone."""
    if hdr.shm is None or sock.getsockopt(zmq.RCVMORE):
        raise ProtocolError(RejectCode.FRAMES, f"batch {hdr.batch_id}: payload frames on a shared-memory lease")
    crc = 0
    if hdr.crc32 is not None:
        for view in views.values():
            crc = zlib.crc32(view.data.cast("B"), crc)
    _check_crc(hdr, crc, checksum)
    check_lengths(views, expected.max_frames, expected.max_tokens, hdr.batch_id)
    check_extra_lengths(views, expected, hdr.batch_id)


def _check_crc(hdr: BatchHeader, crc: int, checksum: bool) -> None:
    if hdr.crc32 is None and checksum:
        raise ProtocolError(RejectCode.CRC, f"batch {hdr.batch_id}: checksum required but missing")
    if hdr.crc32 is not None and crc != hdr.crc32:
        raise ProtocolError(RejectCode.CRC, f"batch {hdr.batch_id}: crc32 mismatch")


def check_lengths(views: Views, max_frames: int, max_tokens: int, batch_id: int) -> None:
    """Lengths outside the bucket would let a step read past a row: SHAPE."""
    mel_len, tok_len = views["mel_len"], views["tok_len"]
    if mel_len.min(initial=0) < 0 or mel_len.max(initial=0) > max_frames:
        raise ProtocolError(RejectCode.SHAPE, f"batch {batch_id}: mel_len outside 0..{max_frames}")
    if tok_len.min(initial=0) < 0 or tok_len.max(initial=0) > max_tokens:
        raise ProtocolError(RejectCode.SHAPE, f"batch {batch_id}: tok_len outside 0..{max_tokens}")


def check_extra_lengths(views: Views, bucket: Bucket, batch_id: int) -> None:
    """Each sequence extra's ``<name>_len`` within 0..S of the bucket: SHAPE otherwise."""
    for spec, padded in zip((e for e in bucket.extras if e.length_key), bucket.seq_lengths):
        lengths = views[spec.length_key]  # type: ignore[index]
        if lengths.min(initial=0) < 0 or lengths.max(initial=0) > padded:
            raise ProtocolError(RejectCode.SHAPE, f"batch {batch_id}: {spec.length_key} outside 0..{padded}")
