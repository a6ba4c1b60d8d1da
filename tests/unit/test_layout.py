"""The layout's rules, checked on the source: imports flow producer -> shared <- consumer, the wheel lists every folder.

docs/design.md "Map": producer and consumer never import each other (they meet only on the wire),
and shared imports neither. Every import counts, also one inside a function, except under
``if TYPE_CHECKING:``, which never runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import tomllib

_ROOT = Path(__file__).resolve().parents[2]
_PACKAGES = ("producer", "consumer", "shared")
_FORBIDDEN = {
    "producer": {"melfeed.consumer", "melfeed"},
    "consumer": {"melfeed.producer", "melfeed"},
    "shared": {"melfeed.producer", "melfeed.consumer", "melfeed"},
}  # "melfeed": the front, which imports all


def _top(module: str) -> str:
    """``melfeed.consumer.feed`` -> ``melfeed.consumer``; ``melfeed`` and ``melfeed.cli`` (the front) -> ``melfeed``;
    any other module -> its top-level name."""
    parts = module.split(".")
    if parts[0] == "melfeed" and len(parts) > 1 and parts[1] in _PACKAGES:
        return ".".join(parts[:2])
    return parts[0]


def _imported_packages(tree: ast.AST) -> set[str]:
    """Packages (``_top``) imported anywhere in ``tree``, skipping ``if TYPE_CHECKING:`` blocks."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return
        if isinstance(node, ast.Import):
            found.update(_top(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(_top(node.module))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _modules(package: str) -> list[Path]:
    front = _ROOT / "consumer" / "melfeed"  # the package melfeed itself, not part of melfeed.consumer
    return sorted(p for p in (_ROOT / package).rglob("*.py") if "__pycache__" not in p.parts and front not in p.parents)


@pytest.mark.parametrize("package", _PACKAGES)
def test_imports_flow_producer_to_shared_from_consumer(package: str) -> None:
    offenders = {}
    for path in _modules(package):
        bad = _imported_packages(ast.parse(path.read_text(encoding="utf-8"))) & _FORBIDDEN[package]
        if bad:
            offenders[str(path.relative_to(_ROOT))] = sorted(bad)
    assert offenders == {}


def test_the_import_check_sees_imports_inside_functions_but_not_type_checking_blocks() -> None:
    code = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import melfeed.consumer.feed\n"
        "def f():\n    from melfeed.producer.batcher import BatchAssembler\n    import melfeed.cli\n"
    )
    assert _imported_packages(ast.parse(code)) == {"typing", "melfeed.producer", "melfeed"}


def test_the_wheel_lists_every_package_folder() -> None:
    """pyproject.toml names the packages one by one (``package-dir`` maps the folders into ``melfeed``): a new
    folder with an ``__init__.py`` that is not listed would be left out of the wheel. Each folder is named
    through its nearest mapped folder (consumer/melfeed/ is ``melfeed``, not ``melfeed.consumer.melfeed``);
    a mapped folder without ``__init__.py`` (deploy/: unit templates) is a data package, listed too."""
    setup = tomllib.loads((_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    mapped = {_ROOT / folder: name for name, folder in setup["package-dir"].items()}
    found = set(mapped.values())
    for root in mapped:
        for init in root.rglob("__init__.py"):
            base = max((m for m in mapped if init.parent.is_relative_to(m)), key=lambda m: len(m.parts))
            found.add(".".join((mapped[base], *init.parent.relative_to(base).parts)))
    assert sorted(setup["packages"]) == sorted(found)
