"""TensorFlow's import in melfeed's own processes leaves JAX and matplotlib out, and only TensorFlow's import; and
it is quiet: no line of TensorFlow's C++ log below TF_CPP_MIN_LOG_LEVEL, not even those it logs while loading.

The case runs in a fresh interpreter: the finder lives in ``sys.meta_path`` and TensorFlow imports once per
process. The test extras install both packages, and TensorFlow 2.21's plain import pulls both in
(docs/performance.md, "TensorFlow's import without JAX and matplotlib"), so a finder that lets them through
fails the first assertion.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from melfeed.shared.service.lean_tensorflow import is_hidden_line, quiet_tensorflow_logs

pytestmark = pytest.mark.tf

REPO = Path(__file__).resolve().parents[4]

_PROBE = """
import json, sys
sys.path.insert(0, {repo!r})
import os
from melfeed.shared.service.lean_tensorflow import quiet_tensorflow_import, skip_optional_imports_of_tensorflow
skip_optional_imports_of_tensorflow()
skip_optional_imports_of_tensorflow()               # twice: still one finder
quiet_tensorflow_import()
os.write(2, b"I0000 00:00:1.0 1 before.cc:1] a native-looking line before the import\\n")
import tensorflow as tf
print("python stderr after the import", file=sys.stderr, flush=True)
os.write(2, b"I0000 00:00:1.0 1 after.cc:1] a native-looking line after the import\\n")
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


@functools.lru_cache(maxsize=1)  # one TensorFlow import for the tests of both finders
def _run_probe() -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _PROBE.format(repo=str(REPO))],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
    )


def _probe() -> dict[str, object]:
    """What a fresh interpreter that installed the finder (twice) before ``import tensorflow`` saw."""
    pytest.importorskip("jax")  # installed by the test extras
    pytest.importorskip("matplotlib")
    proc = _run_probe()
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_tensorflow_imported_in_a_melfeed_process_leaves_jax_and_matplotlib_to_the_code_that_wants_them() -> None:
    lean = _probe()
    assert lean["after_tf"] == {"jax": False, "matplotlib": False}
    assert lean["total"] == 3.0 and lean["jax"] and lean["pyplot"] and lean["keras_jax"] and lean["finders"] == 1


def test_tensorflow_imported_in_a_melfeed_process_prints_no_native_log_line_and_leaves_stderr_as_it_was() -> None:
    proc = _run_probe()
    assert proc.returncode == 0, proc.stderr[-3000:]
    native = [
        line
        for line in proc.stderr.splitlines()
        if re.match(r"[IWEF]\d{4} ", line) or re.search("cuda|cuInit|absl::InitializeLog", line)
    ]
    # TensorFlow's own lines are gone (on a host without a GPU driver: cudart_stub's, logged as it loads); lines
    # written before and after the import are not TensorFlow's and pass, in order, with Python's own.
    assert [line.split("] ")[-1] for line in native] == [
        "a native-looking line before the import",
        "a native-looking line after the import",
    ], proc.stderr
    assert "python stderr after the import" in proc.stderr


@pytest.mark.parametrize(
    ("line", "level", "hidden"),
    [
        (b"I0000 00:00:1796154408.970579   15730 cudart_stub.cc:31] Could not find cuda drivers", 1, True),
        (b"I0000 00:00:1796154408.970579   15730 cudart_stub.cc:31] Could not find cuda drivers", 0, False),
        (b"E0000 00:00:1796154414.231707   15730 cuda_platform.cc:52] failed call to cuInit: (303)", 3, True),
        (b"E0000 00:00:1796154414.231707   15730 cuda_platform.cc:52] failed call to cuInit: (303)", 2, False),
        (b"F0000 00:00:1.0 1 x.cc:1] fatal", 3, False),
        (b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR", 1, True),
        (b"2026-12-01 19:46:46,449 MainProcess INFO melfeed.shared.service.cli: demo data in /tmp", 3, False),
        (b"Traceback (most recent call last):", 3, False),
    ],
)
def test_only_native_log_lines_below_the_level_are_hidden(line: bytes, level: int, hidden: bool) -> None:
    assert is_hidden_line(line, level) is hidden


@pytest.mark.parametrize(
    ("environ", "log_level", "exported"),
    [
        ({}, "INFO", "3"),
        ({}, "warning", "3"),
        ({}, "DEBUG", None),
        ({}, "debug", None),
        ({"TF_CPP_MIN_LOG_LEVEL": "0"}, "INFO", "0"),
        ({"TF_CPP_MIN_LOG_LEVEL": "2"}, "DEBUG", "2"),
    ],
)
def test_melfeed_quiets_tensorflow_unless_the_user_set_its_level_or_asked_for_debug(
    environ: dict[str, str], log_level: str, exported: str | None
) -> None:
    quiet_tensorflow_logs(log_level, environ)
    assert environ.get("TF_CPP_MIN_LOG_LEVEL") == exported
