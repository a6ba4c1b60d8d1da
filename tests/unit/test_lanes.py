"""The test lanes (tests/lanes.py): a file importing TensorFlow without the ``tf`` marker is reported, the scan
follows helpers and melfeed modules, and a ``-m`` expression skips importing only files it deselects whole."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.lanes import (
    deselects_whole_file,
    imports_process_tools,
    imports_tensorflow,
    imports_tensorflow_on_import,
    unmarked_tensorflow_files,
)


@dataclass
class _FakeItem:
    path: Path
    marks: set[str] = field(default_factory=set)

    def get_closest_marker(self, name: str) -> object:
        return name if name in self.marks else None


def _test_file(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "test_x.py"
    path.write_text(source)
    return path


@pytest.mark.parametrize(
    ("source", "imports_tf"),
    [
        ("import tensorflow as tf\n", True),
        ("def test_a() -> None:\n    import tensorflow.experimental.numpy\n", True),  # in a test body: it runs
        ("from tests.steps import tiny_step\n", True),  # through a tests/ helper
        ("from melfeed.consumer.train.step import CompiledStep\n", True),  # through melfeed modules
        ("from melfeed.consumer.train.jit import choose_mode\n", False),  # a train module without TF
        ("import melfeed.consumer\n", False),  # the facade imports TF lazily
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import tensorflow\n", False),
    ],
)
def test_the_scan_follows_imports_into_helpers_and_melfeed_modules(
    tmp_path: Path, source: str, imports_tf: bool
) -> None:
    assert imports_tensorflow(_test_file(tmp_path, source)) is imports_tf


def test_an_import_in_a_test_body_does_not_run_on_collection(tmp_path: Path) -> None:
    lazy = _test_file(tmp_path, "def test_a() -> None:\n    import tensorflow\n")
    assert imports_tensorflow(lazy) and not imports_tensorflow_on_import(lazy)


def test_a_file_importing_tensorflow_without_the_tf_marker_is_reported(tmp_path: Path) -> None:
    unmarked = _test_file(tmp_path, "import tensorflow as tf\n")
    (tmp_path / "marked").mkdir()
    marked = _test_file(tmp_path / "marked", "import tensorflow as tf\n")
    (tmp_path / "pure").mkdir()
    pure = _test_file(tmp_path / "pure", "import numpy as np\n")
    items = [_FakeItem(unmarked), _FakeItem(unmarked, {"tf"}), _FakeItem(marked, {"tf"}), _FakeItem(pure)]
    assert unmarked_tensorflow_files(items, tmp_path) == [unmarked]
    assert unmarked_tensorflow_files(items, tmp_path / "pure") == []  # outside the root: not checked


def test_process_tools_are_found_in_the_file_and_its_helpers(tmp_path: Path) -> None:
    assert imports_process_tools(_test_file(tmp_path, "import subprocess\n"))
    (tmp_path / "helper").mkdir()
    assert imports_process_tools(_test_file(tmp_path / "helper", "from tests.cli_run import run_cli\n"))
    (tmp_path / "pure").mkdir()
    assert not imports_process_tools(_test_file(tmp_path / "pure", "from melfeed.shared.config import loader\n"))


@pytest.mark.parametrize(
    ("markexpr", "marks", "skipped"),
    [
        ("not slow and not tf and not proc", {"tf"}, True),
        ("not slow and not tf and not proc", {"proc"}, True),
        ("not slow and not tf and not proc", set(), False),
        ("not slow", {"tf", "proc"}, False),  # a slow test in it could not be known without importing it
        ("tf", {"proc"}, False),  # another test of the file may carry tf
        ("slow", {"tf"}, False),
        ("not tf or slow", {"tf"}, False),  # a slow one among them would be selected
    ],
)
def test_a_file_is_skipped_only_when_the_expression_rejects_all_it_may_hold(
    markexpr: str, marks: set[str], skipped: bool
) -> None:
    assert deselects_whole_file(markexpr, marks) is skipped
