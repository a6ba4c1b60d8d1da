"""TensorFlow's import without the optional packages it pulls in only because they are installed.

``import tensorflow`` imports JAX (``tensorflow.lite.python.util`` looks for ``jax.jit``) and matplotlib
(Keras's ``keras.src.visualization``) whenever they are installed, which melfeed's ``jax`` and ``report``
extras do. Neither is used by a process that trains, measures or prepares with TensorFlow, and the two cost
1.1-1.5 s of CPU at every start on the 2-core development machine (docs/BENCHMARKS.md, "TensorFlow's
start-up without JAX and matplotlib"). Both modules guard the import and fall back: TFLite's JAX conversion
and Keras's image-gallery plot become unavailable, and neither is reachable from melfeed.

``skip_optional_imports_of_tensorflow()`` installs an import finder that refuses ``jax`` and ``matplotlib``
(and their submodules) to code inside the ``tensorflow`` and ``keras`` packages, and only while
``import tensorflow`` itself runs. Any other importer, a user's model step included, imports them as
usual, and so does Keras afterwards (a ``keras.layers.JaxLayer`` in a user's model still finds JAX).
melfeed's own process entry points call it (the ``melfeed`` command, bench trials, doctor probes, prepare
workers); the library never does, so a user's process keeps TensorFlow's ordinary import.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import FrameType, ModuleType

__all__ = ["SKIPPED_PACKAGES", "skip_optional_imports_of_tensorflow"]

SKIPPED_PACKAGES = ("jax", "matplotlib")
_IMPORTERS = ("tensorflow", "keras")          # the packages whose imports of them are refused
_FROZEN_MACHINERY = "<frozen importlib"     # frames between the importing code and the finder
_IMPORT_MODULE = "importlib/__init__.py"      # importlib.import_module, as Keras's lazy modules call it


class _RefuseToTensorFlow(importlib.abc.MetaPathFinder):
    """Raises ModuleNotFoundError for a skipped package when the importing code is TensorFlow's or Keras's."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if (fullname.partition(".")[0] not in SKIPPED_PACKAGES or not _tensorflow_importing()
                or not _imported_from_tensorflow(sys._getframe(1))):
            return None                           # the usual finders decide
        raise ModuleNotFoundError(f"{fullname} is not imported by TensorFlow in a melfeed process "
                                  "(shared/service/lean_tensorflow.py)", name=fullname)


def _tensorflow_importing() -> bool:
    """``import tensorflow`` is running: its module exists and its spec is still marked initialising (CPython
    sets ``_initializing`` while a module's code runs; without the mark nothing is refused)."""
    module = sys.modules.get("tensorflow")
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def _imported_from_tensorflow(frame: FrameType | None) -> bool:
    """The first frame outside the import machinery runs code of a ``tensorflow`` or ``keras`` module."""
    while frame is not None and (frame.f_code.co_filename.startswith(_FROZEN_MACHINERY)
                                 or frame.f_code.co_filename.endswith(_IMPORT_MODULE)):
        frame = frame.f_back
    if frame is None:
        return False
    module = str(frame.f_globals.get("__name__", ""))
    return module.partition(".")[0] in _IMPORTERS


def skip_optional_imports_of_tensorflow() -> None:
    """Install the finder once per process (before TensorFlow's first import; later it changes nothing)."""
    if not any(isinstance(f, _RefuseToTensorFlow) for f in sys.meta_path):
        sys.meta_path.insert(0, _RefuseToTensorFlow())
