"""Page-locking ring slots for the GPU's DMA engine: ``cudaHostRegister`` through ctypes, when a GPU is present.

Role: a host->device copy from pageable memory goes through a driver staging buffer; from registered
(pinned) memory it is a direct DMA at link speed. TensorFlow has no public call to pin memory it did not
allocate, so ``HostPinner`` loads the CUDA runtime that TensorFlow's GPU install brings
(``nvidia-cuda-runtime-cu*`` wheels: ``site-packages/nvidia/cuda_runtime/lib``; else the system's
``libcudart``) and registers each slot mapping (``cudaHostRegisterPortable``) in the consumer process only
(registration is per process; producers write into the same mappings). Without a runtime or a CUDA device it pins
nothing and says why (``HostPinner.status``: "not pinned: ..."): one INFO line when a CUDA runtime sees a device
or pinning fails, DEBUG on a machine without one (no CUDA line where there is no GPU).
Invariants: a buffer is unregistered before its mapping can go (``ShmSlots.retire`` and ``close``); pinned
bytes = ring slots x slot bytes, locked in RAM (they count against the memory cgroup). Importing this
module loads nothing; the runtime is looked up once per process, on first use.
Shutdown: ``unpin`` every pinned buffer (``ShmSlots.close`` does).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import sys
from pathlib import Path

import numpy as np
import numpy.typing as npt

__all__ = ["HostPinner", "cudart_candidates", "host_pinner"]

log = logging.getLogger(__name__)

_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context of the process


def cudart_candidates() -> list[str]:
    """Where a CUDA runtime may be, in the order tried: the nvidia wheels on ``sys.path``, then the system's."""
    found = [
        str(p)
        for entry in sys.path
        if entry
        for p in sorted((Path(entry) / "nvidia" / "cuda_runtime" / "lib").glob("libcudart.so*"))
    ]
    system = ctypes.util.find_library("cudart")
    return found + ([system] if system else []) + ["libcudart.so.12", "libcudart.so"]


class HostPinner:
    """Registers host buffers with the CUDA runtime ``library`` (None: look it up), if it sees a device."""

    def __init__(self, library: str | None = None) -> None:
        self.pinned = 0  # buffers registered now
        self._lib: ctypes.CDLL | None = None
        self.status = self._load([library] if library else cudart_candidates())
        quiet = self.status.startswith(("not pinned: no CUDA device", "not pinned: no CUDA runtime"))
        (log.debug if quiet else log.info)("ring slots %s", self.status)

    def _load(self, candidates: list[str]) -> str:
        for name in candidates:
            try:
                lib = ctypes.CDLL(name)
            except OSError:
                continue
            count = ctypes.c_int(0)
            code = lib.cudaGetDeviceCount(ctypes.byref(count))
            if code != 0 or count.value < 1:
                return f"not pinned: no CUDA device ({name}: cudaGetDeviceCount error {code}, {count.value} devices)"
            lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
            lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
            self._lib = lib
            return f"pinned with cudaHostRegister ({name}, {count.value} CUDA devices)"
        return "not pinned: no CUDA runtime (libcudart) found"

    @property
    def is_active(self) -> bool:
        return self._lib is not None

    def pin(self, buf: npt.NDArray[np.uint8]) -> bool:
        """Register ``buf``'s pages; False (and a WARNING) when the runtime refuses, e.g. over ``ulimit -l``."""
        if self._lib is None:
            return False
        code = self._lib.cudaHostRegister(buf.ctypes.data, buf.nbytes, _HOST_REGISTER_PORTABLE)
        if code != 0:
            log.warning("cudaHostRegister of %d bytes failed (error %d): this slot stays pageable", buf.nbytes, code)
            return False
        self.pinned += 1
        return True

    def unpin(self, buf: npt.NDArray[np.uint8]) -> None:
        """Unregister ``buf`` (pinned by ``pin``) before its mapping may go."""
        if self._lib is not None and self._lib.cudaHostUnregister(buf.ctypes.data) == 0:
            self.pinned -= 1


@functools.cache
def host_pinner() -> HostPinner:
    """The process's one pinner (the runtime is loaded once)."""
    return HostPinner()
