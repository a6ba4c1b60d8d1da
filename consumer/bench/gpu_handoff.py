"""TensorFlow's GPU hand-off emulated in PyTorch, and the JAX step calibration, for ``gpu_probe``.

Role: on a GPU machine without TensorFlow, put numbers on what TensorFlow's semantics do to a training loop
(docs/design.md "The path of one batch"): the same synthetic step fed four ways from ring slots (``MAP_SHARED``
mappings of /dev/shm files, as the consumer's ring is):
    * ``serial``: a blocking copy from the pageable slot on the step's stream (TensorFlow's eager copy is
      ordered after the queued compute and the host waits for it), then the previous step's loss read to the
      host, which drains the device (TensorFlow's ``BaseGPUDevice::Sync``);
    * ``interval``: the same copy, the loss read every ``read_every`` steps: what the copy alone costs;
    * ``tf_ahead``: melfeed's TensorFlow hand-off as built: the slots pinned, one copy per batch issued on a
      copy thread before the step ahead of it is dispatched, each copy ordered after the compute stream as it
      stood when it was issued and waited for by that thread (TensorFlow's eager copy), losses summed on the device;
    * ``overlapped``: the best a hand-off can do: the slots pinned in place (``cudaHostRegister``), one asynchronous
      copy per batch on a copy stream while the step before it runs, the step waiting on the copy's event
      only, losses summed on the device and read every ``read_every`` steps, and a slot counted free once its
      copy's event completed.
Feed efficiency of each = the step's resident time (the same step on a batch already on the device) / the fed
period. The step is a matmul chain over the batch's floats, its length calibrated to ``target_ms``.
Invariants: nothing here runs without torch and a CUDA device (the caller checks); registered memory is
unregistered before its mapping is closed.
Shutdown: every slot file is unlinked on the way out, whatever failed.
"""

from __future__ import annotations

import functools
import mmap
import os
import statistics
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

__all__ = ["emulate", "jax_step_ms", "registered", "shm_slot"]

_BATCH_SHAPE = (32, 872, 80)  # the demo's largest float32 mel batch: 8.9 MB
_ROWS = 8192  # rows of the batch the step's matmul chain reads
_WIDTH = 4096
_NVML_EVERY_S = 0.1


@contextmanager
def shm_slot(nbytes: int) -> Iterator[mmap.mmap]:
    """A ``MAP_SHARED`` mapping of a /dev/shm file, as a ring slot is; unlinked and unmapped on exit."""
    fd, name = tempfile.mkstemp(prefix="melfeed-probe-", dir="/dev/shm")
    try:
        os.ftruncate(fd, nbytes)
        with mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mapped:
            yield mapped
    finally:
        os.close(fd)
        os.unlink(name)


def emulate(target_ms: float, steps: int, read_every: int, n_slots: int) -> dict[str, Any]:
    """The four patterns (module doc) with a step of about ``target_ms``; their periods and efficiencies."""
    import numpy as np
    import torch

    nbytes = int(np.prod(_BATCH_SHAPE)) * 4
    with ExitStack() as stack:
        maps = [stack.enter_context(shm_slot(nbytes)) for _ in range(n_slots)]
        slots = [np.frombuffer(m, np.uint8) for m in maps]
        for i, slot in enumerate(slots):
            slot.view(np.float32)[:] = np.float32(0.001 * (i + 1))
        weights = torch.randn(_WIDTH, _WIDTH, device="cuda") / _WIDTH**0.5
        project = torch.randn(_BATCH_SHAPE[-1], _WIDTH, device="cuda") / _BATCH_SHAPE[-1] ** 0.5
        depth = _calibrate(target_ms, weights, project, nbytes)

        def step(batch: Any) -> Any:
            h = batch.view(torch.float32)[: _ROWS * _BATCH_SHAPE[-1]].view(_ROWS, -1) @ project
            for _ in range(depth):
                h = torch.tanh(h @ weights)
            return h.mean()

        resident_s = _resident(step, nbytes, steps)
        result: dict[str, Any] = {
            "target_ms": target_ms,
            "matmuls_per_step": depth,
            "resident_step_ms": 1000 * resident_s,
            "steps": steps,
            "read_every": read_every,
            "slots": n_slots,
        }
        for name, run in (
            ("serial", _serial),
            ("interval", _interval),
            ("tf_ahead", _tf_ahead),
            ("overlapped", _overlapped),
        ):
            period_s, util, extra = _timed(functools.partial(run, step, slots, steps, read_every), steps)
            result[name] = {
                "period_ms": 1000 * period_s,
                "feed_efficiency": resident_s / period_s,
                "gpu_util_pct": util,
            } | extra
        del slots
    return result


def _calibrate(target_ms: float, weights: Any, project: Any, nbytes: int) -> int:
    """Matmuls per step so the resident step takes about ``target_ms`` (the time is linear in their count)."""
    import torch

    batch = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")

    def chain(depth: int) -> float:
        h = batch.view(torch.float32)[: _ROWS * _BATCH_SHAPE[-1]].view(_ROWS, -1) @ project
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(5):
            for _ in range(depth):
                h = torch.tanh(h @ weights)
        torch.cuda.synchronize()
        return (time.perf_counter() - started) / 5

    chain(4)  # cuBLAS picks its kernels once
    per_matmul_s = chain(16) / 16
    return max(1, round(target_ms / 1000 / per_matmul_s))


def _resident(step: Callable[[Any], Any], nbytes: int, steps: int) -> float:
    import torch

    batch = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    step(batch)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        loss = step(batch)
    loss.item()
    return (time.perf_counter() - started) / steps


def _serial(step: Callable[[Any], Any], slots: list[Any], steps: int, read_every: int) -> dict[str, Any]:
    import torch

    previous = None
    for k in range(steps):
        batch = torch.from_numpy(slots[k % len(slots)]).to("cuda")  # pageable: the host waits for the copy
        loss = step(batch)
        if previous is not None:
            previous.item()  # drains the device, this step too
        previous = loss
    if previous is not None:
        previous.item()
    return {}


def _interval(step: Callable[[Any], Any], slots: list[Any], steps: int, read_every: int) -> dict[str, Any]:
    import torch

    total = torch.zeros((), device="cuda")
    for k in range(steps):
        total += step(torch.from_numpy(slots[k % len(slots)]).to("cuda"))
        if (k + 1) % read_every == 0:
            total.item()
    total.item()
    return {}


def _overlapped(step: Callable[[Any], Any], slots: list[Any], steps: int, read_every: int) -> dict[str, Any]:
    import torch

    with ExitStack() as pins:
        for slot in slots:
            pins.enter_context(registered(torch, slot))
        hosts = [torch.from_numpy(slot) for slot in slots]
        copy_stream, compute = torch.cuda.Stream(), torch.cuda.current_stream()
        buffers = [torch.empty_like(hosts[0], device="cuda") for _ in range(2)]
        copied = [torch.cuda.Event() for _ in range(2)]
        stepped = [torch.cuda.Event() for _ in range(2)]
        total = torch.zeros((), device="cuda")
        early = 0

        def issue(k: int) -> None:
            with torch.cuda.stream(copy_stream):
                if k >= 2:
                    copy_stream.wait_event(stepped[k % 2])  # the step that read this buffer is done
                buffers[k % 2].copy_(hosts[k % len(hosts)], non_blocking=True)
                copied[k % 2].record(copy_stream)

        issue(0)
        for k in range(steps):
            compute.wait_event(copied[k % 2])
            total += step(buffers[k % 2])
            stepped[k % 2].record(compute)
            if k + 1 < steps:
                issue(k + 1)
            early += int(copied[k % 2].query() and not stepped[k % 2].query())  # slot free before its step ended
            if (k + 1) % read_every == 0:
                total.item()
        total.item()
        torch.cuda.synchronize()
    return {"slots_freed_before_step_end": early}


def _tf_ahead(step: Callable[[Any], Any], slots: list[Any], steps: int, read_every: int) -> dict[str, Any]:
    """TensorFlow's hand-off copying ahead (consumer/train/handoff.py): pinned slots; each copy issued on a copy
    thread, on a copy stream that first waits for the compute stream as it stood when the copy was issued (TensorFlow's
    ``WaitFor``), the thread blocking until the copy is done (its eager copy); step k dispatched once its copy
    is done and the copy of batch k+1 was issued."""
    import torch

    from melfeed.consumer.train.copy_thread import COPY_TIMEOUT_S, NEXT_COPY_START_S, CopyThread

    compute, copy_stream = torch.cuda.current_stream(), torch.cuda.Stream()

    def copy(host: Any) -> Any:
        with torch.cuda.stream(copy_stream):
            copy_stream.wait_stream(compute)  # ordered after the steps dispatched so far
            on_device = host.to("cuda", non_blocking=True)
        copy_stream.synchronize()  # the issuing thread waits for its copy
        on_device.record_stream(compute)
        return on_device

    with ExitStack() as pins:
        for slot in slots:
            pins.enter_context(registered(torch, slot))
        hosts = [torch.from_numpy(slot) for slot in slots]
        copier = CopyThread()
        total = torch.zeros((), device="cuda")
        behind = 0
        try:
            issued = deque([copier.submit(functools.partial(copy, hosts[0]))])
            for k in range(steps):
                if k + 1 < steps:
                    issued.append(copier.submit(functools.partial(copy, hosts[(k + 1) % len(hosts)])))
                batch = issued.popleft().result(COPY_TIMEOUT_S)  # dropped after its step: one buffer per batch ahead
                behind += int(bool(issued) and issued[0].wait_started(NEXT_COPY_START_S))
                total += step(batch)
                if (k + 1) % read_every == 0:
                    total.item()
            total.item()
            torch.cuda.synchronize()
        finally:
            copier.close()
    return {"dispatched_behind_copy": behind}


@contextmanager
def registered(torch: Any, array: Any) -> Iterator[None]:
    """``cudaHostRegister`` of ``array``'s pages (pinned in place), unregistered before the memory goes."""
    cudart = torch.cuda.cudart()
    pointer = array.ctypes.data
    code = cudart.cudaHostRegister(pointer, array.nbytes, 0)
    if int(code) != 0:
        raise RuntimeError(f"cudaHostRegister failed with {code}")
    try:
        yield
    finally:
        cudart.cudaHostUnregister(pointer)


def _timed(run: Callable[[], dict[str, Any]], steps: int) -> tuple[float, float | None, dict[str, Any]]:
    """``run``'s wall time per step over ``steps``, the mean NVML utilisation meanwhile, and its extras."""
    import torch

    samples: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_util, args=(samples, stop), daemon=True)
    torch.cuda.synchronize()
    sampler.start()
    started = time.perf_counter()
    extra = run()
    wall_s = time.perf_counter() - started
    stop.set()
    sampler.join(5.0)
    return wall_s / steps, statistics.mean(samples) if samples else None, extra


def _sample_util(samples: list[float], stop: threading.Event) -> None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no NVML: utilisation stays None
        return
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0))
        while not stop.wait(_NVML_EVERY_S):
            samples.append(float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu))
    finally:
        pynvml.nvmlShutdown()


def jax_step_ms(width: int, layers: int = 4) -> float:
    """Resident step time of ``jax_feed.mlp_step`` at ``width`` on a middle-sized demo batch (median of 10)."""
    import jax
    import numpy as np

    from melfeed.consumer.clients.jax_feed import block_until_ready, init_params, mlp_step

    device = jax.devices()[0]
    params = jax.device_put(init_params(_BATCH_SHAPE[-1], width, layers), device)
    step = mlp_step(layers)
    arrays = jax.device_put(
        {"mel": np.zeros((32, 512, _BATCH_SHAPE[-1]), np.float32), "mel_len": np.full((32,), 512, np.int32)}, device
    )
    params, loss = step(params, arrays)
    block_until_ready(loss)
    times = []
    for _ in range(10):
        started = time.perf_counter()
        params, loss = step(params, arrays)
        block_until_ready(loss)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)
