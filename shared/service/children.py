"""Child processes: where the code lives, and the environment a child interpreter needs to find it.

Role: the one place that knows the repository root (``REPO_ROOT``: the folder holding ``shared/``,
``producer/``, ``consumer/`` and ``run_pipeline.py``, in a checkout and in an installed tree alike)
and how a child ``python -m ...`` finds these packages (``child_env``).
Invariants: nothing here starts a process at import; paths are resolved once, at import.
Shutdown: nothing to shut down.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["REPO_ROOT", "ENTRY_SCRIPT", "child_env"]

REPO_ROOT = Path(__file__).resolve().parents[2]  # shared/service/children.py -> the root
ENTRY_SCRIPT = REPO_ROOT / "run_pipeline.py"


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment plus ``extra``, with ``REPO_ROOT`` first on ``PYTHONPATH``.

    A child started as ``python -m producer.process`` from any working directory then imports
    the same code as its parent, installed or not.
    """
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env
