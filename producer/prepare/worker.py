"""One ``prepare`` worker process: wav -> resampled audio -> log-mel -> two ``.npy`` files.

Role: ``melfeed.producer.prepare.command`` starts N of these (spawn context) and feeds them ``WorkItem``s through
a queue; each answers with one ``WorkResult`` per item. TensorFlow is imported here, after
``CUDA_VISIBLE_DEVICES`` is set to the data GPU ("" = CPU only) in PCI bus order (``shared/gpu_select.py``), never
in the parent.

Invariants:
- Outputs are written atomically: ``.<name>.<pid>.tmp`` in the target directory, fsync, then
  ``os.replace``. A file under its final name is complete; tokens are written before the mel,
  so "both files present and valid" means the utterance is done.
- Same item, same bytes: decoding and resampling are NumPy float64, the mel is computed on one
  thread per CPU worker (TensorFlow intra/inter-op threads = 1) with op determinism on.
- A bad input never stops the worker: it becomes a ``WorkResult`` with a skip reason and a
  one-line detail. A failed write (disk full) does: it is reported as a ``failed`` event.
Shutdown: the worker exits on a ``None`` item, when ``stop`` is set (after the item in hand),
or when its parent dies (PR_SET_PDEATHSIG, and a parent-pid check while idle). SIGINT is
ignored: the parent decides. A normal exit flushes its results, an orphaned one does not wait;
both skip interpreter teardown (``os._exit``: TensorFlow's takes seconds).
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from melfeed.producer.prepare.dsp import LogMel, frame_count, resample
from melfeed.producer.prepare.wav import read_wav
from melfeed.shared.cache.manifest import MEL_DTYPES, TOKEN_DTYPE
from melfeed.shared.config import FeatureConfig
from melfeed.shared.errors import CacheError
from melfeed.shared.gpu_select import gpu_env
from melfeed.shared.service.lean_tensorflow import quiet_tensorflow_import, skip_optional_imports_of_tensorflow
from melfeed.shared.service.lifecycle import die_with_parent
from melfeed.shared.service.priority import lower_cpu_priority

__all__ = ["WorkItem", "WorkResult", "WorkerEvent", "WorkerSpec", "worker_main", "prepare_one", "write_npy_atomic"]

log = logging.getLogger(__name__)

_IDLE_POLL_S = 0.5  # a worker with no task re-checks stop and its parent this often


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a worker needs; pickled into the spawned process."""

    cache_dir: str
    features: FeatureConfig
    n_mels: int
    data_gpu: str  # CUDA_VISIBLE_DEVICES for the worker; "" = CPU only
    gpu_memory_limit_mb: int | None  # per worker; None = grow on demand
    debug_delay_s: float = 0.0  # sleep per item (tests that interrupt a run)
    nice: int = 0  # producer.nice: CPU niceness, set before TensorFlow starts its threads


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One utterance to prepare; the parent has already turned its text into ids."""

    uid: str
    wav_path: str
    tokens: tuple[int, ...]  # ids in 1..vocab_size-1, at least one


@dataclass(frozen=True, slots=True)
class WorkResult:
    """What became of one item. ``reason`` None = written; else a skip reason key."""

    uid: str
    wav_path: str
    reason: str | None  # None, "missing_wav", "bad_wav", "duration" or "error"
    detail: str  # one line, empty when written
    frames: int  # mel frames written (0 when skipped)


@dataclass(frozen=True, slots=True)
class WorkerEvent:
    """A worker's lifecycle message: ``ready`` (detail = ``"<device> nice=<n>"``) or ``failed`` (detail = error)."""

    kind: str
    worker: int
    detail: str


def write_npy_atomic(path: Path, array: npt.NDArray[Any]) -> None:
    """Write ``array`` as a version 1.0 ``.npy`` at ``path`` via temp file, fsync and rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.lib.format.write_array(f, array, version=(1, 0), allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _duration_problem(seconds: float, f: FeatureConfig) -> str | None:
    too_long = f.max_duration_s is not None and seconds > f.max_duration_s
    if seconds < f.min_duration_s or too_long:
        top = "inf" if f.max_duration_s is None else f"{f.max_duration_s:g}"
        return f"{seconds:.3f} s is outside the duration limits {f.min_duration_s:g}..{top} s"
    return None


def prepare_one(item: WorkItem, spec: WorkerSpec, logmel: LogMel) -> WorkResult:
    """Decode, check, resample, analyse and write one utterance (see the module invariants)."""
    try:
        audio, info = read_wav(item.wav_path)
    except CacheError as err:
        reason = "missing_wav" if err.reason == "missing" else "bad_wav"
        return WorkResult(item.uid, item.wav_path, reason, err.reason, 0)
    f = spec.features
    problem = _duration_problem(info.duration_s, f)
    audio = resample(audio, info.sample_rate_hz, f.sample_rate_hz) if problem is None else audio
    if problem is None and frame_count(audio.shape[0], f) == 0:
        problem = f"{audio.shape[0]} samples is too short for one {f.win_samples}-sample window"
    if problem is not None:
        return WorkResult(item.uid, item.wav_path, "duration", problem, 0)
    mel = logmel(audio)
    root = Path(spec.cache_dir)
    write_npy_atomic(root / "tokens" / f"{item.uid}.npy", np.asarray(item.tokens, dtype=TOKEN_DTYPE))
    write_npy_atomic(root / "mels" / f"{item.uid}.npy", mel.astype(MEL_DTYPES["float32"], copy=False))
    return WorkResult(item.uid, item.wav_path, None, "", mel.shape[0])


def _open_device(spec: WorkerSpec) -> str:
    """Import TensorFlow on the data GPU if one is configured and visible, else one CPU thread."""
    os.environ.update(gpu_env(spec.data_gpu))  # before the import; "" hides every GPU
    skip_optional_imports_of_tensorflow()  # a spawned worker: its own import, without JAX/matplotlib
    quiet_tensorflow_import()  # and without C++ lines below TF_CPP_MIN_LOG_LEVEL
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if spec.gpu_memory_limit_mb is not None:
            tf.config.set_logical_device_configuration(
                gpus[0], [tf.config.LogicalDeviceConfiguration(memory_limit=spec.gpu_memory_limit_mb)]
            )
        else:
            tf.config.experimental.set_memory_growth(gpus[0], True)
        return "/GPU:0"
    tf.config.threading.set_intra_op_parallelism_threads(1)  # one worker per core; and determinism
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return "/CPU:0"


def worker_main(spec: WorkerSpec, index: int, tasks: Any, results: Any, stop: Any, parent_pid: int) -> None:
    """Process entry point: serve ``tasks`` (``WorkItem`` or ``None``) until told or orphaned."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Outputs are atomic, so an abrupt end loses nothing. parent_pid: a prepare killed before this line (while
    # this interpreter started) sends no signal; the worker then ends here instead of serving the whole queue.
    die_with_parent(signal.SIGKILL, parent_pid=parent_pid)
    nice = lower_cpu_priority(spec.nice)  # before TensorFlow starts its threads: they inherit it
    try:
        device = _open_device(spec)
        logmel = LogMel(spec.features, spec.n_mels, device)
    except Exception as err:  # top level of the process: report and exit
        results.put(WorkerEvent("failed", index, f"{type(err).__name__}: {err}".splitlines()[0]))
        return
    results.put(WorkerEvent("ready", index, f"{device} nice={nice}"))
    if _serve(spec, index, logmel, tasks, results, stop, parent_pid):
        results.close()
        results.join_thread()  # every result is in the pipe
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: TensorFlow's takes seconds and holds nothing we need


def _serve(spec: WorkerSpec, index: int, logmel: LogMel, tasks: Any, results: Any, stop: Any, parent_pid: int) -> bool:
    """The item loop; False when the parent is gone (nobody reads ``results`` any more)."""
    while not stop.is_set():
        try:
            item = tasks.get(timeout=_IDLE_POLL_S)
        except queue.Empty:
            if os.getppid() != parent_pid:
                return False
            continue
        if item is None:
            return True
        if spec.debug_delay_s:
            time.sleep(spec.debug_delay_s)
        try:
            result = prepare_one(item, spec, logmel)
        except OSError as err:  # reads fail as CacheError, so this is a write: disk full, read-only
            results.put(WorkerEvent("failed", index, f"{err.filename}: cannot write ({err.strerror})"))
            return True
        except Exception as err:  # one odd file must not end a 13k-utterance run; it is reported
            detail = f"unexpected {type(err).__name__}: {err}".splitlines()[0]
            result = WorkResult(item.uid, item.wav_path, "error", detail, 0)
        results.put(result)
    return True
