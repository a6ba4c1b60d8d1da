"""A ``CUDA_VISIBLE_DEVICES`` value from the config: a comma-separated list of GPU indices or UUIDs.

No TensorFlow here: the consumer applies the value before TensorFlow is first imported
(``melfeed.consumer.placement``); the config validates it with ``check_gpu_list``. Every process that sets
``CUDA_VISIBLE_DEVICES`` sets it with ``gpu_env``: CUDA's default order is fastest first, while nvidia-smi and
NVML number the GPUs by PCI bus id, so an index means the same GPU to CUDA, NVML and the operator only
under ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (docs/design.md "GPU placement").
"""

from __future__ import annotations

import re

__all__ = ["DEVICE_ORDER", "check_gpu_list", "gpu_env"]

DEVICE_ORDER = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}  # indices as nvidia-smi and NVML number them

# an index ("0"), a GPU UUID ("GPU-8f6c…", as nvidia-smi -L prints it) or a MIG instance ("MIG-…")
_ENTRY = re.compile(r"^(?:\d+|(?:GPU|MIG)-[0-9A-Za-z][0-9A-Za-z/-]*)$")


def check_gpu_list(value: str) -> str | None:
    """None when ``value`` is a valid list ("" = no GPU), else one line saying what is wrong."""
    if value == "":
        return None
    for entry in value.split(","):
        if not _ENTRY.match(entry):
            return f"entry {entry!r} is neither a GPU index nor a GPU-/MIG- UUID (comma-separated, no spaces)"
    return None


def gpu_env(visible: str) -> dict[str, str]:
    """The variables that make CUDA see exactly ``visible`` ("" = no GPU), numbered in PCI bus order."""
    return {**DEVICE_ORDER, "CUDA_VISIBLE_DEVICES": visible}
