"""README.md stays a page a newcomer reads through: at most 200 lines, linking every task page of docs/guide/.

The detail lives in the guide (one page per task) and in docs/reference/; the README points to each guide page,
so a page added to docs/guide/ is reachable from the first page a reader opens.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_MAX_README_LINES = 200  # what a newcomer reads in a few minutes before choosing a guide page
_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)")


def _linked_paths(markdown: str, doc: Path) -> set[Path]:
    return {(doc.parent / target).resolve() for target in _LINK.findall(markdown) if "://" not in target}


def test_the_readme_is_at_most_200_lines() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= _MAX_README_LINES, f"README.md has {len(lines)} lines; move detail into docs/guide/"


def test_the_readme_links_every_guide_page() -> None:
    readme = REPO / "README.md"
    linked = _linked_paths(readme.read_text(encoding="utf-8"), readme)
    pages = sorted((REPO / "docs" / "guide").glob("*.md"))
    assert pages, "docs/guide/ has no pages"
    missing = [page.name for page in pages if page.resolve() not in linked]
    assert missing == []


def test_the_link_reader_sees_a_relative_link_and_ignores_a_url() -> None:
    readme = REPO / "README.md"
    found = _linked_paths("[a](docs/guide/x.md#step) [b](https://example.org/y.md)", readme)
    assert found == {(REPO / "docs" / "guide" / "x.md").resolve()}
