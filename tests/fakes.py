"""Synthetic inputs for unit tests of pure logic."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import numpy.typing as npt
import zmq

from melfeed.consumer.flow.plan import PlannedBatch
from melfeed.consumer.observe.snapshot import GpuRow, ProducerRow, Snapshot, field_names, snapshot_dict
from melfeed.producer.batcher import BuiltBatch
from melfeed.shared.wire.buckets import Bucket
from melfeed.shared.wire.layout import ARRAY_KEYS
from melfeed.shared.wire.protocol import Message, decode_header, encode


def ljspeech_like(n: int, seed: int = 0) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Frames (1-10 s at 22050 Hz, hop 256) and roughly proportional token counts."""
    rng = np.random.default_rng(seed)
    seconds = np.clip(rng.normal(6.6, 2.2, n), 1.0, 10.1)
    frames = np.round(seconds * 22050 / 256).astype(np.int64)
    tokens = np.clip(np.round(seconds * 15 + rng.normal(0, 5, n)), 10, 190).astype(np.int64)
    return frames, tokens


def _plain(value: object) -> object:
    """A schema record (or a list of them) as its JSON form; anything else as given."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) and not isinstance(value, type) else value


def producer_row(producer_id: str = "producer-1", **overrides: object) -> ProducerRow:
    """A producer row of a healthy run (``overrides`` replace fields)."""
    row = ProducerRow(id=producer_id, batches=60, batches_per_s=5.1, read_ms=1.2, assemble_ms=0.3, send_ms=0.4)
    return dataclasses.replace(row, **overrides)  # type: ignore[arg-type]  # tests set wrong types on purpose


def gpu_row(role: str = "model", index: int = 0, **overrides: object) -> GpuRow:
    """A sampled GPU of a healthy run (``overrides`` replace fields)."""
    row = GpuRow(
        role=role,
        index=index,
        uuid=f"GPU-{role}-{index}",
        util_pct=93.0,
        mem_used_mib=21000.0,
        mem_total_mib=81559.0,
        power_w=310.0,
    )
    return dataclasses.replace(row, **overrides)  # type: ignore[arg-type]


def metrics_snapshot(t_unix_s: float, **overrides: object) -> dict[str, object]:
    """One metrics snapshot in its JSON form, built through the schema (values of a healthy training line).

    ``overrides`` replace fields (rows may be given as ``ProducerRow``/``GpuRow`` or as plain objects, and any value,
    even a wrong one, passes: tests of the readers need bad snapshots); a name the schema lacks is a ``TypeError``.
    """
    unknown = sorted(set(overrides) - set(field_names()))
    if unknown:
        raise TypeError(f"not snapshot fields: {', '.join(unknown)}")
    snap = snapshot_dict(
        Snapshot(
            t_unix_s=t_unix_s,
            uptime_s=12.3,
            phase="training",
            step=120,
            steps_total=300,
            loss=0.91,
            window_s=5.0,
            stall_pct=0.1,
            batches_per_s=10.2,
            samples_per_s=320.0,
            bytes_per_s=9.1e7,
            step_p50_ms=90.1,
            step_p99_ms=120.3,
            step_cv=0.05,
            padding_efficiency=0.86,
            queue_depth_mean=2.1,
            queue_depth_hist=[0, 3, 40, 7],
            lease_window=2,
            leases_outstanding=3,
            producers_alive=2,
            producers=[producer_row()],
            rejects={},
            duplicates=0,
            quarantined=0,
            compiles_after_ready=0,
            gpus=[],
            jit_compile="xla",
            outputs={"loss": 0.91},
            producers_benched=[],
            rank=0,
            world=1,
            checkpoint_failures=0,
            connections_cut=0,
            feed_efficiency=0.97,
            hello_repeats=0,
            useful_work=0.83,
        )
    )
    snap.update({name: _plain(value) for name, value in overrides.items()})
    return snap


class FakeDealer:
    """The producer worker's DEALER socket without ZeroMQ: the test queues inbound messages, sends are recorded.

    ``poll`` on an empty inbox lets ``clock`` run for the whole timeout (nothing else would have woken
    the socket), then calls ``on_idle`` so a test can stop the loop or script the consumer's next words.
    With ``refuse_sends`` every send fails as a full or unconnected DEALER does (``zmq.Again``).
    """

    def __init__(
        self, clock: FakeClock, on_idle: Callable[[FakeDealer], None] | None = None, refuse_sends: bool = False
    ) -> None:
        self.clock = clock
        self.on_idle = on_idle
        self.refuse_sends = refuse_sends
        self.inbox: deque[list[bytes]] = deque()
        self.sent: list[list[bytes]] = []  # every frame as bytes, in send order
        self.poll_timeouts_ms: list[int] = []
        self.connected_to: list[str] = []  # every ``connect`` call's address

    def connect(self, addr: str) -> None:
        self.connected_to.append(addr)

    def push(self, *msgs: Message) -> None:
        self.inbox.extend([encode(m)] for m in msgs)

    def poll(self, timeout: int, flags: int) -> int:
        self.poll_timeouts_ms.append(timeout)
        if not self.inbox:
            self.clock.advance(timeout / 1000)
            if self.on_idle is not None:
                self.on_idle(self)
        return zmq.POLLIN if self.inbox else 0

    def recv_multipart(self, flags: int) -> list[bytes]:
        if not self.inbox:
            raise zmq.Again()
        return self.inbox.popleft()

    def send_multipart(self, msg_parts: list[bytes | zmq.Frame], flags: int = 0, copy: bool = True) -> None:
        if self.refuse_sends:
            raise zmq.Again()
        self.sent.append([p.bytes if isinstance(p, zmq.Frame) else bytes(p) for p in msg_parts])

    def messages(self) -> list[Message]:
        """The header of every message sent, decoded."""
        return [decode_header(frames[0]) for frames in self.sent]


class FakeAssembler:
    """A ``BatchAssembler`` stand-in: zero-filled batches (``rows`` x ``frames`` x ``n_mels``), or ``error`` raised."""

    def __init__(self, rows: int = 2, frames: int = 4, n_mels: int = 3, error: Exception | None = None) -> None:
        self.read_s_total = 0.0
        self.error = error
        self.built: list[int] = []  # batch ids built
        self._shapes = {"mel": (rows, frames, n_mels), "mel_len": (rows,), "tokens": (rows, frames), "tok_len": (rows,)}
        self.rows_used: list[list[int]] = []  # each ``use_rows`` call's rows
        self.buckets_used: list[tuple[Bucket, ...]] = []  # each ``use_buckets`` call's shapes

    def use_rows(self, rows: list[int]) -> None:
        self.rows_used.append(list(rows))
        r, (_, frames, n_mels) = rows[0], self._shapes["mel"]
        self._shapes = {"mel": (r, frames, n_mels), "mel_len": (r,), "tokens": (r, frames), "tok_len": (r,)}

    def use_buckets(self, buckets: tuple[Bucket, ...]) -> None:
        """Each bucket's shapes from now on (a learned plan); the fake builds every bucket as bucket 0."""
        self.buckets_used.append(buckets)
        b = buckets[0]
        r, t, lt, n = b.batch_size, b.max_frames, b.max_tokens, b.n_mels
        self._shapes = {"mel": (r, t, n), "mel_len": (r,), "tokens": (r, lt), "tok_len": (r,)}

    def build(
        self,
        batch_id: int,
        bucket: int,
        sample_ids: list[int],
        target: dict[str, npt.NDArray[np.generic]] | None = None,
    ) -> BuiltBatch:
        if self.error is not None:
            raise self.error
        self.built.append(batch_id)
        dtypes = {"mel": np.float32, "mel_len": np.int32, "tokens": np.int32, "tok_len": np.int32}
        arrays = target if target is not None else {k: np.zeros(self._shapes[k], dtypes[k]) for k in ARRAY_KEYS}
        return BuiltBatch(batch_id, bucket, arrays)


def realistic_run(
    n_lines: int = 120, interval_s: float = 2.0, seed: int = 0, gpus: bool = True
) -> list[dict[str, object]]:
    """A run's metrics lines: compile, then training with two producers (the second joins late and
    drops out for a while), a stall episode, and one GPU entry per role in the second half of the lines."""
    rng = np.random.default_rng(seed)
    t0, lines, step = 1763900000.0, [], 0
    for i in range(n_lines):
        t = t0 + i * interval_s
        if i < 8:
            lines.append(
                metrics_snapshot(
                    t,
                    uptime_s=2.0 + i * interval_s,
                    phase="compiling",
                    step=0,
                    loss=None,
                    stall_pct=None,
                    batches_per_s=None,
                    samples_per_s=None,
                    step_p50_ms=None,
                    step_p99_ms=None,
                    step_cv=None,
                    queue_depth_mean=None,
                    leases_outstanding=0,
                    producers=[],
                )
            )
            continue
        stalled = 50 <= i < 60
        rate = float(np.clip(rng.normal(4.0 if stalled else 11.0, 0.4), 0.5, None))
        step += int(rate * interval_s)
        producers = [producer_row("producer-1", batches=int(rate * 5), batches_per_s=rate * 0.55)]
        if 20 <= i < 70 or i >= 85:  # producer-2 joins late, leaves, comes back
            producers.append(
                producer_row("producer-2", batches=int(rate * 4), batches_per_s=rate * 0.45, read_ms=1.4, send_ms=0.5)
            )
        gpu = [
            gpu_row("model", 0, util_pct=float(np.clip(rng.normal(40 if stalled else 93, 3), 0, 100))),
            gpu_row("data", 1, util_pct=float(np.clip(rng.normal(18, 4), 0, 100)), mem_used_mib=2100.0, power_w=90.0),
        ]
        p50 = float(rng.normal(88.0, 1.5))
        lines.append(
            metrics_snapshot(
                t,
                uptime_s=2.0 + i * interval_s,
                step=step,
                loss=2.5 * np.exp(-i / 60) + 0.3,
                stall_pct=float(np.clip(rng.normal(55 if stalled else 0.4, 0.3), 0, 100)),
                batches_per_s=rate,
                samples_per_s=rate * 32,
                step_p50_ms=p50,
                step_p99_ms=p50 + float(abs(rng.normal(25, 8))),
                queue_depth_mean=0.2 if stalled else 2.6,
                leases_outstanding=len(producers) * 2,
                lease_window=2,
                producers_alive=len(producers),
                producers=producers,
                gpus=gpu if gpus and i >= n_lines // 2 else [],
            )
        )
    lines[-1]["phase"] = "done"
    return lines


class FakeClock:
    """Monotonic seconds that move only when a test says so (unit tests never sleep)."""

    def __init__(self, start_s: float = 0.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> float:
        """Move time forward; returns the new time."""
        if seconds < 0:
            raise ValueError("a monotonic clock never goes back")
        self.now_s += seconds
        return self.now_s


class FakeSlotFiles:
    """The ring's shared-memory slot files as the receiver session sees them, without files.

    ``retire(slot)`` bumps the slot's generation and records the call, as ``ShmSlots.retire`` does.
    """

    def __init__(self, n_slots: int, directory: str = "/dev/shm/fake", private: frozenset[int] = frozenset()) -> None:
        self.directory = Path(directory)
        self.retired = 0
        self.retired_slots: list[int] = []
        self._gens = [0] * n_slots
        self._private = private

    def name(self, slot: int) -> str:
        return f"melfeed-1-1-s{slot}-g{self._gens[slot]}"

    def generation(self, slot: int) -> int:
        return self._gens[slot]

    def is_shared(self, slot: int) -> bool:
        return slot not in self._private

    def retire(self, slot: int) -> None:
        self._gens[slot] += 1
        self.retired += 1
        self.retired_slots.append(slot)


class FakePlan:
    """An epoch plan of one bucket: batch ``b`` holds samples ``rows*b .. rows*b + rows - 1``."""

    def __init__(self, rows: int = 2) -> None:
        self.rows = rows

    def batch(self, batch_id: int) -> PlannedBatch:
        first = batch_id * self.rows
        return PlannedBatch(batch_id, 0, 0, tuple(range(first, first + self.rows)))


class NvmlError(Exception):
    """What FakeNvml raises (pynvml raises its NVMLError)."""


class FakeNvml:
    """The part of pynvml the sampler calls: GPUs by NVML index (PCI bus order), some of them inaccessible."""

    def __init__(
        self, uuids: list[str], names: list[str] | None = None, broken: tuple[int, ...] = (), power: bool = True
    ) -> None:
        self.uuids, self.names, self.broken, self.power = uuids, names or ["NVIDIA H100"] * len(uuids), broken, power
        self.shut = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if index in self.broken or index >= len(self.uuids):
            raise NvmlError("Insufficient Permissions" if index in self.broken else "Invalid Argument")
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return self.uuids[handle].encode()  # older pynvml returns bytes

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self.names[handle]

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=40 + handle, memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(used=2**30, total=2**32, free=0)

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        if not self.power:
            raise NvmlError("Not Supported")
        return 150_000
