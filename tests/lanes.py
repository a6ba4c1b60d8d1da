"""The test lanes: which test files import TensorFlow or start processes, read from the source.

``tf`` marks a test that imports TensorFlow (about 6 s of CPU per process), ``proc`` one that starts real
processes or opens sockets; ``-m "not slow and not tf and not proc"`` is the fast lane.
tests/conftest.py marks ``proc`` itself: every integration test, a unit test whose file imports process or
socket tools (``imports_process_tools``), one using a fixture that starts processes. A unit test file declares
``pytestmark = pytest.mark.tf`` itself (also one whose child processes import TensorFlow, which no scan of
imports sees); ``unmarked_tensorflow_files`` finds one that imports TensorFlow without it, following imports
through the helpers under tests/ and the melfeed modules they load.

Counted imports: in a test file or a tests/ helper, every import (one inside a test body runs too); in a
melfeed module, those that run when it is imported (not inside a function, not under ``if TYPE_CHECKING:``),
since melfeed imports TensorFlow lazily where it can.
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Protocol

REPO = Path(__file__).resolve().parent.parent


def _is_type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imported_names(tree: ast.AST, *, into_functions: bool) -> set[str]:
    """Dotted module names imported in ``tree`` (``from a.b import c`` gives ``a.b`` and ``a.b.c``)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if _is_type_checking_block(node):
            return
        if not into_functions and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


_PACKAGE_DIRS = {"consumer": REPO / "consumer", "producer": REPO / "producer", "shared": REPO / "shared"}


def _source_of(module: str) -> Path | None:
    """The file of a tests/ helper or a melfeed module, found in the tree without importing anything (a melfeed
    module imported for its path could load TensorFlow); None for any other name."""
    parts = module.split(".")
    if parts[0] == "tests":
        base = REPO.joinpath(*parts)
    elif parts[0] == "melfeed" and len(parts) > 1 and parts[1] in _PACKAGE_DIRS:
        base = _PACKAGE_DIRS[parts[1]].joinpath(*parts[2:])
    elif parts[0] == "melfeed":
        base = REPO.joinpath("consumer", *parts)  # the front: consumer/melfeed/
    else:
        return None
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@functools.cache
def _imports_of(module: str, *, into_functions: bool) -> frozenset[str]:
    """The modules a tests/ helper or a melfeed module imports (empty for any other module); only those run on
    import for a melfeed module, whatever ``into_functions`` says."""
    path = _source_of(module)
    if path is None:
        return frozenset()
    into = into_functions and module.startswith("tests.")
    return frozenset(_imported_names(ast.parse(path.read_text()), into_functions=into))


def _is_tensorflow(module: str) -> bool:
    return module == "tensorflow" or module.startswith("tensorflow.")


_PROCESS_MODULES = (
    "subprocess",
    "multiprocessing",
    "socket",
    "zmq",
    "tests.cli_run",
    "tests.job_procs",
    "tests.procs",
    "tests.systemd_ns",
)


def _starts_processes(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in _PROCESS_MODULES)


def _reaches(path: Path, is_target: Callable[[str], bool], *, into_functions: bool = True) -> bool:
    """Whether the test file at ``path`` imports a module ``is_target`` accepts, directly or through the helpers
    under tests/ and the melfeed modules it imports; without ``into_functions``, only the imports that run when
    the file is imported count."""
    pending = list(_imported_names(ast.parse(path.read_text()), into_functions=into_functions))
    seen: set[str] = set()
    while pending:
        module = pending.pop()
        if is_target(module):
            return True
        if module not in seen:
            seen.add(module)
            pending.extend(_imports_of(module, into_functions=into_functions))
    return False


def imports_tensorflow(path: Path) -> bool:
    """Whether running the test file at ``path`` imports TensorFlow, directly or through the modules it imports."""
    return _reaches(path, _is_tensorflow)


@functools.cache
def imports_tensorflow_on_import(path: Path) -> bool:
    """Whether importing the test file at ``path`` (collecting it) imports TensorFlow."""
    return _reaches(path, _is_tensorflow, into_functions=False)


@functools.cache
def imports_process_tools(path: Path) -> bool:
    """Whether the test file at ``path`` itself imports what starts processes or opens sockets (subprocess,
    multiprocessing, socket, zmq) or a tests/ helper that starts them. Imports are not followed further: a
    fake may name zmq's types, and most of melfeed can start something that a pure-logic test never does."""
    names = _imported_names(ast.parse(path.read_text()), into_functions=True)
    return any(_starts_processes(name) for name in names)


_EXPRESSION_WORDS = {"and", "or", "not", "True", "False"}


def _carries(marks: set[str]) -> Callable[..., bool]:
    """A ``-m`` matcher: whether a test with ``marks`` carries the mark named (a mark's keyword arguments ignored)."""
    return lambda name, /, **kwargs: name in marks


def deselects_whole_file(markexpr: str, known_marks: set[str]) -> bool:
    """Whether the ``-m`` expression ``markexpr`` rejects every test that carries ``known_marks``, whatever other
    marks it has: then collecting its file (importing it, maybe TensorFlow) only to deselect it can be skipped."""
    from _pytest.mark.expression import Expression  # the parser of ``-m`` itself: no second grammar to keep

    expression = Expression.compile(markexpr)
    others = sorted(set(re.findall(r"[A-Za-z_][\w.-]*", markexpr)) - _EXPRESSION_WORDS - known_marks)
    for present in itertools.product((False, True), repeat=len(others)):
        marks = known_marks | {name for name, on in zip(others, present, strict=True) if on}
        if expression.evaluate(_carries(marks)):
            return False
    return True


class _Item(Protocol):
    """What ``unmarked_tensorflow_files`` reads of a collected test (``pytest.Item``)."""

    @property
    def path(self) -> Path: ...
    def get_closest_marker(self, name: str) -> object: ...


def unmarked_tensorflow_files(items: Iterable[_Item], root: Path) -> list[Path]:
    """The test files under ``root`` that import TensorFlow while a test of theirs lacks the ``tf`` marker."""
    candidates = {
        item.path for item in items if item.path.is_relative_to(root) and item.get_closest_marker("tf") is None
    }
    return sorted(path for path in candidates if imports_tensorflow(path))
