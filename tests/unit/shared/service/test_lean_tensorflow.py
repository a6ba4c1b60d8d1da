"""TensorFlow's import in melfeed's own processes leaves JAX and matplotlib out, and only TensorFlow's import.

The case runs in a fresh interpreter: the finder lives in ``sys.meta_path`` and TensorFlow imports once per
process. The test extras install both packages, and TensorFlow 2.21's plain import pulls both in
(docs/BENCHMARKS.md, "TensorFlow's start-up without JAX and matplotlib"), so a finder that lets them through
fails the first assertion.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]

_PROBE = """
import json, sys
sys.path.insert(0, {repo!r})
from melfeed.shared.service.lean_tensorflow import skip_optional_imports_of_tensorflow
skip_optional_imports_of_tensorflow()
skip_optional_imports_of_tensorflow()               # twice: still one finder
import tensorflow as tf
after_tf = {{name: name in sys.modules for name in ("jax", "matplotlib")}}
total = float(tf.reduce_sum(tf.constant([1.0, 2.0])))
from keras.src.utils.module_utils import LazyModule  # Keras's own imports, once TensorFlow's has ended
keras_jax = LazyModule("jax").available and LazyModule("matplotlib.pyplot").available
import jax, matplotlib.pyplot                      # and the user's own
from melfeed.shared.service.lean_tensorflow import _RefuseToTensorFlow
print(json.dumps({{"after_tf": after_tf, "total": total, "jax": hasattr(jax, "jit"),
                  "pyplot": hasattr(matplotlib.pyplot, "figure"), "keras_jax": keras_jax,
                  "finders": sum(isinstance(f, _RefuseToTensorFlow) for f in sys.meta_path)}}))
"""


def _probe() -> dict[str, object]:
    """What a fresh interpreter that installed the finder (twice) before ``import tensorflow`` saw."""
    pytest.importorskip("jax")                      # installed by the test extras
    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(repo=str(REPO))], capture_output=True,
                          text=True, timeout=240, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_tensorflow_imported_in_a_melfeed_process_leaves_jax_and_matplotlib_to_the_code_that_wants_them() -> None:
    lean = _probe()
    assert lean["after_tf"] == {"jax": False, "matplotlib": False}
    assert lean["total"] == 3.0 and lean["jax"] and lean["pyplot"] and lean["keras_jax"] and lean["finders"] == 1

