"""The library facade: ``from melfeed.consumer import Consumer, Batch`` works, without TensorFlow or a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from melfeed import consumer
from melfeed.consumer.feed import Batch, Consumer
from melfeed.consumer.flow.plan import PlannedBatch

_ROOT = Path(__file__).resolve().parents[3]


def test_the_facade_exports_the_library_classes_themselves() -> None:
    assert consumer.__all__ == ["Consumer", "Batch", "PlannedBatch"]
    assert (consumer.Consumer, consumer.Batch, consumer.PlannedBatch) == (Consumer, Batch, PlannedBatch)


def test_import_consumer_loads_no_tensorflow() -> None:
    # A fresh interpreter: this test session may have imported TensorFlow already.
    code = (
        "import sys; from melfeed.consumer import Batch, Consumer; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tensorflow'))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=_ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_no_module_of_the_package_imports_the_facade_back() -> None:
    offenders = []
    for path in sorted((_ROOT / "consumer").rglob("*.py")):
        if path.name == "__init__.py" and path.parent.name == "consumer":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "consumer" and node.level == 0:
                offenders.append(str(path.relative_to(_ROOT)))
            elif isinstance(node, ast.Import) and any(a.name == "consumer" for a in node.names):
                offenders.append(str(path.relative_to(_ROOT)))
    assert offenders == []
