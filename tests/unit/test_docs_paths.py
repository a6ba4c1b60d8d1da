"""The documentation names only files and tests that exist.

Every backticked repository path in the READMEs and docs/*.md (``consumer/job/agree.py``, ``flow/plan.py``
in consumer/README.md, ``tests/.../test_x.py::test_name``) and every relative Markdown link must resolve, so a
rename or a removed test cannot leave a stale name behind. Only tokens that start at a repository folder (or,
in a package README, at one of that package's folders) and end in a file suffix or ``/`` are checked: runtime
files (``run.json``, ``CACHE/mels``) and placeholders are not paths of this repository.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/ARCHITECTURE.md", "docs/BENCHMARKS.md", "consumer/README.md", "producer/README.md",
        "shared/README.md", "deploy/README.md")
_TOP = ("consumer", "producer", "shared", "tests", "deploy", "docs")
_PATH = re.compile(r"^[A-Za-z0-9_.@-]+(?:/[A-Za-z0-9_.@-]+)*(?:\.(?:py|md|yaml|json|toml|png|service|target|env)|/)"
                   r"(?:::[A-Za-z_][A-Za-z0-9_]*)?$")
_TICKED = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def _candidates(text: str) -> list[str]:
    return [*_TICKED.findall(text), *_LINK.findall(text)]


def _resolve(token: str, doc: Path) -> Path | None:
    """The file ``token`` names, or None when it is not a repository path at all (so not checked)."""
    path = token.partition("::")[0]
    first = path.split("/", 1)[0]
    if "/" in path and first in _TOP:
        return REPO / path
    if "/" in path and (doc.parent / first).is_dir() and doc.parent != REPO:
        return doc.parent / path               # a package README naming its own sub-folder: flow/plan.py
    if path in ("run_pipeline.py", "pyproject.toml"):
        return REPO / path
    if "::" in token and path.startswith("test_") and path.endswith(".py"):
        hits = sorted(REPO.glob(f"tests/**/{path}"))
        return hits[0] if len(hits) == 1 else REPO / "tests" / path   # ambiguous or missing: reported
    return None


def _problems(doc_name: str, text: str | None = None) -> list[str]:
    doc = REPO / doc_name
    out = []
    for token in _candidates(doc.read_text(encoding="utf-8") if text is None else text):
        token = token.strip()
        if not _PATH.match(token):
            continue
        target = _resolve(token, doc)
        if target is None:
            continue
        if not target.exists():
            out.append(f"{doc_name}: `{token}`: no such file")
            continue
        _, _, test = token.partition("::")
        if test and not re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(test)}\b",
                                  target.read_text(encoding="utf-8"), re.MULTILINE):
            out.append(f"{doc_name}: `{token}`: {target.name} defines no {test}")
    return out


@pytest.mark.parametrize("doc_name", DOCS)
def test_every_repository_path_and_test_named_in_the_docs_exists(doc_name: str) -> None:
    assert _problems(doc_name) == []


def test_the_checker_reports_a_stale_path_and_a_missing_test() -> None:
    assert _resolve("consumer/no_such_room.py", REPO / "README.md") == REPO / "consumer" / "no_such_room.py"
    assert _resolve("flow/plan.py", REPO / "consumer" / "README.md") == REPO / "consumer" / "flow" / "plan.py"
    assert _resolve("run.json", REPO / "README.md") is None and not _PATH.match("STATE_DIR/*.json")
    stale = "`tests/unit/test_layout.py::test_no_such_test` and `shared/gone.py` and [x](docs/GONE.md)"
    found = _problems("docs/ARCHITECTURE.md", stale)
    assert [p.split(": ", 1)[1] for p in found] == [
        "`tests/unit/test_layout.py::test_no_such_test`: test_layout.py defines no test_no_such_test",
        "`shared/gone.py`: no such file", "`docs/GONE.md`: no such file"]
