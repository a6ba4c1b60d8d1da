"""A ``CUDA_VISIBLE_DEVICES`` value from the config: a comma-separated list of GPU indices or UUIDs.

No TensorFlow here: the consumer applies the value before TensorFlow is first imported
(``melfeed.consumer.placement``); the config validates it with ``check_gpu_list``.
"""

from __future__ import annotations

import re

__all__ = ["check_gpu_list"]

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
