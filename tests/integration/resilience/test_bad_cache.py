"""Bad cache files met at read time by real producer processes, under both ``producer.bad_samples`` policies.

The cache is indexed first and then damaged in place, so the manifest still loads and only the
producers' reads find the damage: every case ``verify-cache`` knows (missing, truncated, wrong
dtype, rank or mel bins, Fortran order, NaN, Inf), and entries that are not regular files (a FIFO,
a symlink to /dev/zero), which must be refused without blocking the producer.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from melfeed.consumer.feed import Consumer
from melfeed.consumer.flow.plan import EpochPlan
from melfeed.shared.cache.demo_data import demo_utterance_id, write_demo_cache
from melfeed.shared.cache.manifest import load_manifest
from melfeed.shared.config import PipelineConfig
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.wire.buckets import build_buckets
from tests import procs
from tests.conftest import ProducerGroup

N_UTTERANCES = 48
STEPS = 20  # > 2 epochs: every bad sample is applied 2-3 times
BUCKETS = {"batch_size": 8, "num_buckets": 2}  # small batches: many batches from a small cache


def _set(frame: int, value: float) -> Callable[[np.ndarray], np.ndarray]:
    def change(mel: np.ndarray) -> np.ndarray:
        mel[frame, frame % mel.shape[1]] = value
        return mel

    return change


def _rewrite(path: Path, change: Callable[[np.ndarray], np.ndarray]) -> None:
    np.save(path, change(np.load(path)))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-16])


def _fifo(path: Path) -> None:  # opening it without O_NONBLOCK would block the producer forever
    path.unlink()
    os.mkfifo(path)


def _dev_zero(path: Path) -> None:  # reading it never ends
    path.unlink()
    path.symlink_to("/dev/zero")


# case -> (sample index, file, damage, what the producer's message says about it)
CASES: dict[str, tuple[int, str, Callable[[Path], None], str]] = {
    "missing": (3, "mels", Path.unlink, ": missing"),
    "truncated": (7, "tokens", _truncate, ": file changed since index (size "),
    "float64": (11, "mels", lambda p: _rewrite(p, lambda m: m.astype(np.float64)), ": file changed since index (size "),
    "rank3": (
        15,
        "mels",
        lambda p: _rewrite(p, lambda m: m[:, :, None]),
        ": file changed since index (header says shape (",
    ),
    "40_bins": (19, "mels", lambda p: _rewrite(p, lambda m: m[:, :40]), ": file changed since index (size "),
    "fortran": (
        23,
        "mels",
        lambda p: _rewrite(p, np.asfortranarray),
        ": file changed since index (Fortran order not supported)",
    ),
    "nan": (27, "mels", lambda p: _rewrite(p, _set(40, np.nan)), ": 1 non-finite values (NaN/Inf) in the first "),
    "inf": (31, "mels", lambda p: _rewrite(p, _set(2, -np.inf)), ": 1 non-finite values (NaN/Inf) in the first "),
    "fifo": (35, "mels", _fifo, ": not a regular file (fifo)"),
    "dev_zero": (39, "tokens", _dev_zero, ": not a regular file (character device)"),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bad-cache") / "pristine"
    write_demo_cache(path, n_utterances=N_UTTERANCES)  # indexed: manifest.json written
    return path


def _damaged(pristine: Path, dest: Path, cases: list[str]) -> tuple[Path, dict[int, Path]]:
    """A copy of the indexed cache with ``cases`` applied in place; returns it and {sample: bad file}."""
    cache = Path(shutil.copytree(pristine, dest, symlinks=True))
    bad = {}
    for case in cases:
        sample, sub, damage, _ = CASES[case]
        path = cache / sub / f"{demo_utterance_id(sample)}.npy"
        damage(path)
        bad[sample] = path
    return cache, bad


def _cfg(cache: Path, endpoint: str, steps: int) -> PipelineConfig:
    return config_from_mapping(
        {
            "cache_dir": str(cache),
            "buckets": BUCKETS,
            "consumer": {"steps": steps, "wait_timeout_s": 0.5},
            "transport": {"endpoint": endpoint, "heartbeat_interval_s": 0.2},
        }
    )


def _run_quarantine(
    cache: Path, endpoint: str, producers: ProducerGroup, count: int, bad: dict[int, Path]
) -> tuple[list[tuple[int, str]], int, int]:
    """One run: (batch id, content digest) per batch, quarantined rows seen, consumer's count."""
    got, seen = [], 0
    with Consumer(_cfg(cache, endpoint, STEPS)) as consumer:
        assert consumer.plan.batches_per_epoch <= STEPS // 2  # the run covers two epochs or more
        group = producers.start(cache, endpoint, count, buckets=BUCKETS)  # default policy: quarantine
        frames = consumer.manifest.frames
        for batch in consumer.batches():
            a = batch.arrays
            for row, sid in enumerate(consumer.plan.batch(batch.batch_id).sample_ids):
                if sid in bad:
                    seen += 1
                    assert a["mel_len"][row] == a["tok_len"][row] == 0
                    assert not a["mel"][row].any() and not a["tokens"][row].any()
                else:
                    assert a["mel_len"][row] == min(frames[sid], a["mel"].shape[1])
            got.append((batch.batch_id, hashlib.sha256(b"".join(x.tobytes() for x in a.values())).hexdigest()))
        stats = consumer._receiver.stats()
        group.terminate()
        assert group.wait(procs.WAIT_S) == 0
    assert stats.duplicates_dropped == 0 and stats.rejects == {}
    return got, seen, stats.quarantined


def test_quarantine_empties_bad_rows_counts_them_and_is_deterministic(
    pristine: Path, tmp_path: Path, endpoint: str, producers: ProducerGroup, capfd: pytest.CaptureFixture[str]
) -> None:
    cache, bad = _damaged(pristine, tmp_path / "cache", list(CASES))
    runs = []
    for count in (2, 1):  # independent runs; the producer count must not matter
        got, seen, counted = _run_quarantine(cache, endpoint, producers, count, bad)
        assert [bid for bid, _ in got] == list(range(STEPS))
        assert seen > len(bad)  # some bad samples were applied more than once
        assert counted == seen  # bad sample x times its batch was applied
        runs.append(got)
    assert runs[0] == runs[1]  # bit-identical batches: every producer decided the same
    err = capfd.readouterr().err
    for sample, path in bad.items():  # the producer names every quarantined file
        assert f"quarantined sample={sample} " in err and f": {path}: " in err


class _FailureLines(logging.Handler):
    """Collects the consumer's ``producer failed ...`` lines; ``seen`` is set on the first."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("producer failed id="):
            self.lines.append(record.getMessage())
            self.seen.set()


def _plan_position(cache: Path, endpoint: str, sample: int) -> int:
    """The first batch id of epoch 0 that holds ``sample``."""
    manifest = load_manifest(cache)
    cfg = _cfg(cache, endpoint, 1)
    plan = EpochPlan(
        build_buckets(manifest.frames, manifest.token_counts, 80, cfg.buckets), manifest.fingerprint, cfg.seed
    )
    return next(b.batch_id for b in plan.epoch(0) if sample in b.sample_ids)


@pytest.mark.parametrize("case", list(CASES))
def test_fail_policy_stops_the_producers_with_78_naming_the_file(
    case: str,
    pristine: Path,
    tmp_path: Path,
    endpoint: str,
    producers: ProducerGroup,
    capfd: pytest.CaptureFixture[str],
) -> None:
    cache, bad = _damaged(pristine, tmp_path / "cache", [case])
    [(sample, path)] = bad.items()
    first_bad = _plan_position(cache, endpoint, sample)
    start = max(0, first_bad - 2)  # resume just before it: two good batches, then the bad one
    with Consumer(_cfg(cache, endpoint, first_bad + 3), start_batch=start) as consumer:
        group = producers.start(cache, endpoint, 1, buckets=BUCKETS, producer={"bad_samples": "fail"})
        assert group.wait(procs.WAIT_S) == 78  # a data error: the supervisor does not restart it
        ids = []
        while (batch := consumer.next_batch(0.5)) is not None:  # bounded: no more batches come
            ids.append(batch.batch_id)
            consumer.release(batch)
        assert ids == list(range(start, start + len(ids))) and first_bad not in ids
    err = capfd.readouterr().err
    assert f"bad cache file in batch {first_bad} (producer.bad_samples=fail); stopping: {path}{CASES[case][3]}" in err
    assert "exited 78 (configuration error); stopping all producers" in err


def test_fail_policy_producer_tells_the_consumer_its_exit_code_and_the_file_before_exiting(
    pristine: Path, tmp_path: Path, endpoint: str, producers: ProducerGroup
) -> None:
    # The BYE's exit code and reason reach the consumer's log (melfeed.consumer.flow.session) as data.
    cache, bad = _damaged(pristine, tmp_path / "cache", ["missing"])
    [(sample, path)] = bad.items()
    first_bad = _plan_position(cache, endpoint, sample)
    failures = _FailureLines()
    logging.getLogger("melfeed.consumer").addHandler(failures)
    try:
        with Consumer(_cfg(cache, endpoint, first_bad + 3), start_batch=max(0, first_bad - 2)) as consumer:
            group = producers.start(cache, endpoint, 1, buckets=BUCKETS, producer={"bad_samples": "fail"})
            deadline_s = time.monotonic() + procs.WAIT_S
            while not failures.seen.is_set() and time.monotonic() < deadline_s:  # each turn waits <= 0.5 s
                if (batch := consumer.next_batch(0.5)) is not None:
                    consumer.release(batch)
            assert group.wait(procs.WAIT_S) == 78
    finally:
        logging.getLogger("melfeed.consumer").removeHandler(failures)
    assert len(failures.lines) == 1, failures.lines  # one BYE, one line
    assert failures.lines[0].startswith(
        f"producer failed id=producer-1 exit=78: CacheError: {path}{CASES['missing'][3]}"
    )
