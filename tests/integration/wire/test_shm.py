"""The same-host shared-memory path with real processes: zombie fencing, crash cleanup, small shm_dir.

Fencing oracle: a producer that is declared dead while it holds a slot lease and then writes into its
mapping must never change a batch the consumer hands out; its late BATCH is refused (UNKNOWN_PEER).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq

from melfeed.consumer.feed import Consumer
from melfeed.producer.slot_maps import SlotMappings
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import ConfigError
from melfeed.shared.wire.layout import ARRAY_KEYS
from melfeed.shared.wire.protocol import (
    CAP_SHM,
    PROTOCOL_VERSION,
    BatchHeader,
    Err,
    Hello,
    LeaseGrant,
    RejectCode,
    Welcome,
    decode_header,
    encode,
)
from tests import procs
from tests.conftest import ProducerGroup

HB_S = 0.2


def _cfg(cache: Path, endpoint: str, shm_dir: Path, steps: int, mode: str = "shm") -> object:
    return config_from_mapping(
        {
            "cache_dir": str(cache),
            "consumer": {"steps": steps, "wait_timeout_s": 0.5},
            "transport": {
                "endpoint": endpoint,
                "heartbeat_interval_s": HB_S,
                "liveness_intervals": 5,
                "mode": mode,
                "shm_dir": str(shm_dir),
            },
        }
    )


def _recv(sock: zmq.Socket[bytes], kind: type, timeout_s: float = procs.WAIT_S) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(100):
            msg = decode_header(sock.recv_multipart()[0])
            if isinstance(msg, kind):
                return msg
    raise AssertionError(f"no {kind.__name__} within {timeout_s} s")


@contextlib.contextmanager
def _scribbling(views: list[dict[str, np.ndarray]]) -> Iterator[threading.Event]:
    """Write 0xFF (NaN mels, -1 lengths) into the zombie's mappings until the block ends."""
    stop = threading.Event()

    def run() -> None:
        while not stop.is_set():
            for v in views:
                for arr in v.values():
                    arr.view(np.uint8)[...] = 0xFF
            time.sleep(0.001)

    thread = threading.Thread(target=run, name="zombie", daemon=True)
    thread.start()
    try:
        yield stop
    finally:
        stop.set()
        thread.join(5)


def test_a_zombie_writing_into_its_old_slot_never_changes_a_batch_and_its_late_batch_is_fenced(
    demo_cache: Path, tmp_path: Path, producers: ProducerGroup
) -> None:
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    endpoint = f"ipc://{tmp_path}/m.sock"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    zombie = ctx.socket(zmq.DEALER)
    zombie.setsockopt(zmq.LINGER, 0)
    try:
        with Consumer(_cfg(demo_cache, endpoint, shm_dir, 30)) as consumer:  # type: ignore[arg-type]
            zombie.connect(endpoint)
            zombie.send(
                encode(
                    Hello(
                        PROTOCOL_VERSION,
                        "zombie-1",
                        consumer.manifest.fingerprint,
                        consumer._bucket_set.as_wire(),
                        consumer._cfg.n_mels,
                        consumer._cfg.seed,
                        1,
                        [CAP_SHM],
                    )
                )
            )
            welcome = _recv(zombie, Welcome)
            grant = _recv(zombie, LeaseGrant)
            assert isinstance(welcome, Welcome) and isinstance(grant, LeaseGrant) and welcome.shm_dir == str(shm_dir)
            maps = SlotMappings(consumer._bucket_set, 4, shm_dir=str(shm_dir), endpoint=endpoint)
            views = [maps.views(welcome.shm_dir, x.shm, x.bucket) for x in grant.leases if x.shm is not None]
            assert views, "the zombie got no slot lease"
            # It never heartbeats: declared dead after 1 s, its leases reissued to the real producer.
            producers.start(demo_cache, endpoint, 1, transport={"mode": "shm", "shm_dir": str(shm_dir)})
            deadline = time.monotonic() + procs.WAIT_S
            while consumer._receiver.stats().leases_reissued < len(views):
                assert time.monotonic() < deadline, "the zombie's leases were never reissued"
                time.sleep(0.05)
            with _scribbling(views):  # it wakes up and writes ...
                got = []
                for batch in consumer.batches():
                    a = batch.arrays
                    assert np.isfinite(a["mel"]).all() and a["mel_len"].min() >= 0 and a["tok_len"].min() >= 0, (
                        f"batch {batch.batch_id} was scribbled on"
                    )
                    got.append(batch.batch_id)
                lease = grant.leases[0]  # ... and delivers its batch late
                arrays = [views[0][k] for k in ARRAY_KEYS]
                assert lease.shm is not None
                zombie.send(
                    encode(
                        BatchHeader(
                            grant.epoch,
                            lease.batch_id,
                            lease.bucket,
                            [list(x.shape) for x in arrays],
                            [x.dtype.name for x in arrays],
                            None,
                            [],
                            (lease.shm.slot, lease.shm.generation),
                        )
                    )
                )
                err = _recv(zombie, Err)
            stats = consumer._receiver.stats()
    finally:
        zombie.close(0)
        ctx.term()
    assert got == list(range(30))
    assert isinstance(err, Err) and err.code == RejectCode.UNKNOWN_PEER
    assert stats.rejects == {RejectCode.UNKNOWN_PEER: 1} and stats.shm_retired >= len(views)
    assert list(shm_dir.iterdir()) == []  # close() unlinked every slot file


def _stopped_in_sleep(pid: int) -> bool:
    """SIGSTOP ``pid`` while it sleeps in the debug delay (it then holds a built, unsent lease)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        number = Path(f"/proc/{pid}/syscall").read_text().split()[0]
    except OSError:
        number = ""
    if number in ("35", "230"):  # nanosleep, clock_nanosleep (x86-64)
        return True
    os.kill(pid, signal.SIGCONT)
    return False


# The killed consumer: the library (``Consumer``, whose transport makes the slot files) taking BATCHES batches,
# then holding them until SIGKILLed; it imports no TensorFlow. The consumer CLI killed mid-run and resuming from
# its checkpoint in shm mode: tests/integration/resilience/test_chaos.py (the shared-memory and payload-frame
# producers' run); its own sockets left behind: tests/integration/service/test_leftovers.py.
_VICTIM = """\
import sys, threading
from pathlib import Path
from melfeed.consumer.feed import Consumer
from melfeed.shared.config.loader import load_config
with Consumer(load_config(sys.argv[1])) as feed:
    for n, _batch in enumerate(feed.batches(), start=1):
        if n == int(sys.argv[2]):
            Path(sys.argv[3]).touch()
            threading.Event().wait(60)    # SIGKILLed long before; else its files go as it exits (the test fails)
            sys.exit(1)
"""

# Steps: about 10 are applied by the SIGCONT (5, then 2 s with one producer); the rest (>= 20 x 150 ms) is the
# time the thawed producer has to deliver its late BATCH (sent as its delay ends, <= 300 ms) to a running consumer.
_FENCED_STEPS = 40


def test_the_shm_consumer_removes_a_killed_ones_files_and_fences_a_sigstopped_producer_with_an_exact_audit(
    demo_cache: Path, tmp_path: Path
) -> None:
    """A consumer SIGKILLed in shm mode leaves its slot files; the consumer CLI started next removes them at
    start. In its run one of two producers is SIGSTOPped holding a built lease, declared dead (its leases
    reissued and applied) and thawed: its late BATCH is refused (UNKNOWN_PEER), the audit is exact, every
    batch took one copy, and the slot files go at exit."""
    state = tmp_path / "state"
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    sections = {
        "transport": {"mode": "shm", "shm_dir": str(shm_dir)},
        "consumer": {"feed_efficiency_steps": 0},  # feed efficiency is not checked
        "buckets": {"max_shapes": 1},  # one compiled program: buckets are not the subject
    }
    endpoint = f"ipc://{tmp_path}/c.sock"
    config = procs.write_config(
        tmp_path / "c.yaml", demo_cache, endpoint, state, _FENCED_STEPS, producer={"count": 2}, **sections
    )
    # The killed consumer's own producer, stopped before the CLI starts: no batch leased in the killed
    # consumer's epoch reaches the CLI, so its one UNKNOWN_PEER reject is the thawed producer's.
    first = procs.write_config(
        tmp_path / "first.yaml", demo_cache, endpoint, state, _FENCED_STEPS, producer={"count": 1}, **sections
    )
    log = tmp_path / "run.log"
    summary = tmp_path / "summary.json"
    holding = tmp_path / "holding"
    feeding = procs.start("producer", first, log)
    victim = procs.start_python(_VICTIM, first, log, "10", str(holding))
    try:
        assert procs.wait_for_file(holding, victim, 60), procs.tail(log)
        victim.kill()
        victim.wait(procs.WAIT_S)
        stale = sorted(p.name for p in shm_dir.iterdir())
        assert stale and all(n.startswith(f"melfeed-{victim.pid}-") for n in stale)
    finally:
        procs.stop(victim)
        procs.stop(feeding)
    producers = procs.start("producer", config, log, "--debug-delay-ms", "300")
    consumer = procs.start("consumer", config, log, "--summary-json", str(summary))
    try:
        assert procs.wait_for_records(state, 5, consumer, 60), procs.tail(log)
        deadline = time.monotonic() + procs.WAIT_S
        victim_pid = None
        while victim_pid is None:
            assert time.monotonic() < deadline, "never caught a producer in its debug delay"
            for pid in procs.child_pids(producers.pid):
                if _stopped_in_sleep(pid):
                    victim_pid = pid
                    break
            time.sleep(0.02)
        before = procs.audit_records(state)
        time.sleep(1.0 * 2)  # past liveness (5 x 0.2 s): its leases are reissued
        assert procs.wait_for_records(state, before + 3, consumer, 30), procs.tail(log)  # ... and applied
        os.kill(victim_pid, signal.SIGCONT)
        assert consumer.wait(60) == 0, procs.tail(log)
    finally:
        procs.stop(consumer)
        procs.stop(producers)
    rc, doc, text = procs.run_audit(state, tmp_path)
    assert rc == 0 and (doc["lost"], doc["duplicated"], doc["out_of_order"], doc["wrong_content"]) == (0, 0, 0, 0), text
    assert doc["content_checked"] and doc["applied"] == _FENCED_STEPS == doc["expected"], text
    out = json.loads(summary.read_text())
    assert out["rejects"].get(RejectCode.UNKNOWN_PEER, 0) >= 1, out["rejects"]  # the late BATCH, fenced
    assert out["payload_copies_per_batch"] == 1.0
    assert f"removed {len(stale)} stale shared-memory slot files" in log.read_text()
    assert list(shm_dir.iterdir()) == []  # the stale files went at start, the new ones at exit


def test_a_tiny_shm_dir_falls_back_to_payload_frames_with_one_warning_and_still_delivers(
    demo_cache: Path, tmp_path: Path, producers: ProducerGroup, caplog: pytest.LogCaptureFixture
) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a 1 MiB tmpfs needs root")
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    endpoint = f"ipc://{tmp_path}/m.sock"
    try:
        with pytest.raises(ConfigError, match="too small.*transport.mode is shm"):  # asked for: never replaced
            Consumer(_cfg(demo_cache, endpoint, small, 12)).start()  # type: ignore[arg-type]
        with caplog.at_level(logging.WARNING, logger="melfeed.consumer.transport.shm_slots"):
            with Consumer(_cfg(demo_cache, endpoint, small, 12, "auto")) as consumer:  # type: ignore[arg-type]
                assert consumer._shm is None
                producers.start(demo_cache, endpoint, 1, transport={"mode": "shm"})
                copies = {b.copies for b in consumer.batches()}
                assert consumer.applied == 12 and copies == {4}
                assert consumer._receiver.stats().bytes_received > 0
        warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and str(small) in warnings[0] and "too small" in warnings[0], warnings
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], check=False)
