"""Real producer processes over real ipc sockets into the library consumer (no TensorFlow step).

The delivery tests run on both same-host data paths (``transport_mode``): shared-memory slot files
(producers build in the ring, BATCH is a header) and ZeroMQ payload frames.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq

from melfeed.consumer.feed import Consumer
from melfeed.shared.cache.demo_data import write_demo_cache
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.wire.protocol import Hello, MsgKind, RejectCode, encode
from tests import procs
from tests.conftest import ProducerGroup


def _cfg(cache: Path, endpoint: str, steps: int, mode: str = "auto", **consumer: object):  # type: ignore[no-untyped-def]
    return config_from_mapping(
        {
            "cache_dir": str(cache),
            "consumer": {"steps": steps, "wait_timeout_s": 0.5, **consumer},
            "transport": {"endpoint": endpoint, "heartbeat_interval_s": 0.2, "mode": mode},
        }
    )


def _collect(consumer: Consumer, copies: set[int]) -> list[tuple[int, str]]:
    """(batch id, content digest) of every batch; each one's real rows checked against the manifest and its
    padding rows found all zero (slots are reused: stale rows would show)."""
    out = []
    frames = consumer.manifest.frames
    for batch in consumer.batches():
        planned = consumer.plan.batch(batch.batch_id)
        assert batch.planned == planned  # the identity the lease carried is the plan's
        n = len(planned.sample_ids)
        assert list(batch.arrays["mel_len"][:n]) == [
            min(frames[i], batch.arrays["mel"].shape[1]) for i in planned.sample_ids
        ]
        assert not batch.arrays["mel_len"][n:].any() and not batch.arrays["mel"][n:].any()
        digest = hashlib.sha256(b"".join(a.tobytes() for a in batch.arrays.values())).hexdigest()
        out.append((batch.batch_id, digest))
        copies.add(batch.copies)
    return out


def test_batches_arrive_once_in_plan_order_with_identical_content_and_zero_padding_for_1_and_3_producers(
    demo_cache: Path, endpoint: str, producers: ProducerGroup, transport_mode: str
) -> None:
    steps = 40  # > one epoch of the 200-utterance cache (7 batches): every slot is reused
    runs = []
    for count in (1, 3):
        copies: set[int] = set()
        with Consumer(_cfg(demo_cache, endpoint, steps, transport_mode)) as consumer:
            group = producers.start(demo_cache, endpoint, count, transport={"mode": transport_mode})
            got = _collect(consumer, copies)
            stats = consumer._receiver.stats()
            group.terminate()
            assert group.wait(procs.WAIT_S) == 0
        assert [bid for bid, _ in got] == list(range(steps))
        assert stats.producers_seen == count
        assert stats.duplicates_dropped == 0 and stats.rejects == {}
        # shm: every batch was built in a slot file (1 copy), zmq: payload frames (4 copies)
        assert copies == ({1} if transport_mode == "shm" else {4})
        # bytes received = the batch bytes delivered into the ring, on either path
        assert stats.bytes_received == sum(_batch_nbytes(consumer, bid) for bid in range(stats.batches_received))
        runs.append(got)
    assert runs[0] == runs[1]  # invariant 1: the plan does not depend on producer count


def _batch_nbytes(consumer: Consumer, batch_id: int) -> int:
    """Bytes of the four arrays of planned batch ``batch_id`` (its bucket's shapes)."""
    bucket = consumer._bucket_set.buckets[consumer.plan.batch(batch_id).bucket]
    dtypes = bucket.dtypes()
    return sum(int(np.prod(shape)) * np.dtype(dtypes[k]).itemsize for k, shape in bucket.shapes().items())


def test_malformed_messages_are_rejected_and_counted_while_a_good_producer_streams(
    demo_cache: Path, endpoint: str, producers: ProducerGroup
) -> None:
    ctx = zmq.Context()
    bad = ctx.socket(zmq.DEALER)
    bad.setsockopt(zmq.LINGER, 0)
    try:
        with Consumer(_cfg(demo_cache, endpoint, 30)) as consumer:
            bad.connect(endpoint)
            producers.start(demo_cache, endpoint, 1)
            sent = [
                [b"\xc1\x00"],
                [b"\x85"],
                [msgpack.packb({"x": 1})],
                [msgpack.packb({"t": 42})],
                [msgpack.packb({"t": int(MsgKind.HB), "epoch": 1})],  # unknown peer
                [encode(Hello(1, "evil", "0" * 16, [[0, 1, 2, 3, 80]], 80, 0, 1))],  # contract
                [encode(Hello(9, "future", "x", [], 80, 0, 1))],  # protocol version
                [msgpack.packb({"t": int(MsgKind.BYE), "epoch": 1}), b"extra"],
            ]  # frames
            for frames in sent:
                bad.send_multipart(frames)
            replies = []
            while bad.poll(2000):
                replies.append(msgpack.unpackb(bad.recv()))
                if len(replies) == len(sent):
                    break
            ids = [b.batch_id for b in consumer.batches()]
            rejects = consumer._receiver.stats().rejects
            stale = consumer._receiver.stats().stale_dropped
    finally:
        bad.close()
        ctx.term()
    assert ids == list(range(30))
    assert [r["code"] for r in replies] == [
        RejectCode.DECODE,
        RejectCode.DECODE,
        RejectCode.SCHEMA,
        RejectCode.TYPE,
        RejectCode.UNKNOWN_PEER,
        RejectCode.CONTRACT,
        RejectCode.PROTO,
        RejectCode.FRAMES,
    ]
    assert sum(rejects.values()) == len(sent)
    assert stale == 1  # the HB from an old epoch; the 2-frame BYE is refused (FRAMES) before its epoch is read


def test_producer_with_a_different_dataset_exits_78(
    demo_cache: Path, endpoint: str, tmp_path: Path, producers: ProducerGroup
) -> None:
    other = tmp_path / "other"
    write_demo_cache(other, n_utterances=50, seed=99)
    with Consumer(_cfg(demo_cache, endpoint, 5)) as consumer:
        group = producers.start(other, endpoint, 2)
        assert group.wait(60) == 78
        assert consumer._receiver.stats().rejects.get(RejectCode.CONTRACT, 0) >= 1


def test_producers_started_first_join_when_the_consumer_appears_and_leave_with_bye_and_exit_0_at_the_plan_end(
    demo_cache: Path, endpoint: str, producers: ProducerGroup, transport_mode: str
) -> None:
    # back-off ceiling 0.5 s: both must join before 20 batches are done (shm delivers them fast)
    group = producers.start(
        demo_cache,
        endpoint,
        2,
        transport={"mode": transport_mode, "connect_backoff_max_s": 0.5},
        producer={"exit_at_plan_end": True},
    )
    time.sleep(2.0)  # producers up, consumer absent
    assert group.poll() is None
    with Consumer(_cfg(demo_cache, endpoint, 20, transport_mode)) as consumer:
        deadline = time.monotonic() + 30  # both join (a loaded machine may start one late) ...
        while consumer._receiver.stats().producers_seen < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert consumer._receiver.stats().producers_seen == 2
        ids = [b.batch_id for b in consumer.batches()]  # ... and the batches arrive
        # The consumer stays open: no signal, the supervisor ends once both children had told it they were done.
        assert group.wait(procs.WAIT_S) == 0
        deadline = time.monotonic() + procs.WAIT_S  # their BYEs are in (the consumer drops them at once)
        while consumer._receiver.stats().producers_alive and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = consumer._receiver.stats()
    assert ids == list(range(20))
    assert stats.producers_seen == 2 and stats.producers_alive == 0 and stats.producer_failures == 0


def test_as_dataset_yields_fixed_shape_elements_for_keras(
    demo_cache: Path, endpoint: str, producers: ProducerGroup
) -> None:
    with Consumer(_cfg(demo_cache, endpoint, 6)) as consumer:
        producers.start(demo_cache, endpoint, 1)
        ds = consumer.as_dataset(single_shape=True)
        elements = list(ds)
        biggest = max(consumer._bucket_set.buckets, key=lambda b: b.max_frames)
    assert len(elements) == 6
    assert ds.element_spec[1].shape.as_list() == [biggest.batch_size, biggest.max_frames, 80]
    for feats, mel in elements:
        assert mel.shape == (biggest.batch_size, biggest.max_frames, 80)
        assert int(feats["mel_len"].numpy().max()) <= biggest.max_frames
        assert int(feats["tok_len"].numpy().min()) >= 0
