"""The documentation names only files, tests and sections that exist, and the design's map names every module.

Every Markdown page of the repository (``README.md``, ``docs/**/*.md``, the package READMEs; found by glob, so a
new page is checked too) is checked: every backticked repository path (``consumer/job/agree.py``, ``flow/plan.py``
in consumer/README.md, ``tests/.../test_x.py::test_name``) and every relative Markdown link must resolve, so a
rename or a removed test cannot leave a stale name behind. Only tokens that start at a repository folder (or,
in a package README, at one of that package's folders) and end in a file suffix or ``/`` are checked: runtime
files (``run.json``, ``CACHE/mels``) and placeholders are not paths of this repository.

Every section a tracked text file cites as ``PAGE.md "Section"`` (``docs/design.md "Map"``, ``deploy/README.md "..."``)
must be a heading of that page, and
docs/design.md "Map" must list every module of the packages, one line each.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_NOT_DOCS = ("tests", "build", ".git")  # test data and build output are no documentation


def _doc_pages() -> tuple[str, ...]:
    """Every Markdown page of the repository outside tests/ and build/, as repository-relative paths."""
    pages = (p.relative_to(REPO) for p in REPO.rglob("*.md"))
    return tuple(
        sorted(
            p.as_posix()
            for p in pages
            if p.parts[0] not in _NOT_DOCS and not any(part.startswith(".") for part in p.parts)
        )
    )


DOCS = _doc_pages()
_TOP = ("consumer", "producer", "shared", "tests", "deploy", "docs")
_PATH = re.compile(
    r"^[A-Za-z0-9_.@-]+(?:/[A-Za-z0-9_.@-]+)*(?:\.(?:py|md|yaml|json|toml|png|service|target|env)|/)"
    r"(?:::[A-Za-z_][A-Za-z0-9_]*)?$"
)
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
        return doc.parent / path  # a package README naming its own sub-folder: flow/plan.py
    if path in ("run_pipeline.py", "pyproject.toml"):
        return REPO / path
    if "::" in token and path.startswith("test_") and path.endswith(".py"):
        hits = sorted(REPO.glob(f"tests/**/{path}"))
        return hits[0] if len(hits) == 1 else REPO / "tests" / path  # ambiguous or missing: reported
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
        if test and not re.search(
            rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(test)}\b", target.read_text(encoding="utf-8"), re.MULTILINE
        ):
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
    found = _problems("docs/design.md", stale)
    assert [p.split(": ", 1)[1] for p in found] == [
        "`tests/unit/test_layout.py::test_no_such_test`: test_layout.py defines no test_no_such_test",
        "`shared/gone.py`: no such file",
        "`docs/GONE.md`: no such file",
    ]


def test_every_markdown_page_of_the_repository_is_checked() -> None:
    assert {"README.md", "docs/design.md", "docs/security.md", "docs/performance.md", "producer/README.md"} <= set(DOCS)
    assert not [d for d in DOCS if d.startswith(("tests/", "build/"))]


_CITED_SECTION = re.compile(
    r'(?<![\w/.-])((?:(?:docs|consumer|producer|shared|deploy)/(?:[\w-]+/)*)?[\w-]+\.md),?\s*\(?"([^"\n]+)"'
)
_HEADING = re.compile(r"^#{2,4} (.+?)\s*$", re.MULTILINE)


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    this = Path(__file__).resolve().relative_to(REPO).as_posix()  # its own examples are planted stale
    return [
        REPO / n for n in names if n.endswith((".py", ".md", ".toml", ".yaml", ".service", ".target")) and n != this
    ]


def _stale_sections(text: str, where: str) -> list[str]:
    """Each ``PAGE.md "Section"`` in ``text`` whose page has no such heading (a page by its repository path, or a
    bare name beside ``where``: README.md at the top, your-model.md in docs/guide/)."""
    out = []
    for page, section in _CITED_SECTION.findall(text):
        if "/" not in page and not where.endswith(".md"):
            continue  # a bare name in code is a file name at run time ("README.md", ...), not a citation
        target = REPO / page if "/" in page else (REPO / where).parent / page
        headings = set(_HEADING.findall(target.read_text(encoding="utf-8"))) if target.is_file() else set()
        if section not in headings:
            out.append(f'{where}: {page} "{section}": no such section')
    return out


def test_every_cited_section_of_a_docs_page_is_a_heading_of_it() -> None:
    found = [
        p
        for f in _tracked_text_files()
        if f.exists()
        for p in _stale_sections(f.read_text(encoding="utf-8"), f.relative_to(REPO).as_posix())
    ]
    assert found == []


def test_the_section_checker_reports_a_missing_section_and_page() -> None:
    text = (
        'see docs/design.md "Map" and docs/design.md,\n"No such section", and docs/gone.md "Map"; '
        'consumer/README.md "Metrics", README.md "Quick start", README.md "Gone" and '
        'deploy/README.md, "Scale and restart"'
    )
    assert _stale_sections(text, "x.md") == [
        'x.md: docs/design.md "No such section": no such section',
        'x.md: docs/gone.md "Map": no such section',
        'x.md: consumer/README.md "Metrics": no such section',
        'x.md: README.md "Gone": no such section',
    ]
    assert _stale_sections(text, "x.py")[-1] == 'x.py: consumer/README.md "Metrics": no such section'


_MAP_LINE = re.compile(r"^(\S+)\s{2,}\S", re.MULTILINE)


def _map_entries() -> list[str]:
    """The paths the design's map lists, one per line of its code block."""
    design = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    section = design.split("\n## Map\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    return _MAP_LINE.findall(block)


def test_the_design_map_lists_every_module_once_and_nothing_that_is_gone() -> None:
    listed = _map_entries()
    modules = {
        p.relative_to(REPO).as_posix()
        for top in ("consumer", "producer", "shared", "docs")
        for p in (REPO / top).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    # A subpackage's __init__.py is listed as its folder.
    unlisted = sorted(
        m
        for m in modules
        if m not in listed and not (m.endswith("/__init__.py") and m[: -len("__init__.py")] in listed)
    )
    assert unlisted == []
    assert sorted(e for e in listed if not (REPO / e).exists()) == []
    assert len(listed) == len(set(listed))
