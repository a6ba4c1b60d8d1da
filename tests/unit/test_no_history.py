"""The repository describes what melfeed does, never how it got there.

Code, tests and docs (every tracked text file) name no development session, issue or task number, and narrate
no change: no "used to", "previously", "older producers", "as before", no timing diary ("was 12 ms"), and no
result file named after who measured when (``bench-run-s12.json``). Protocol and producer *sessions* are a
part of the design (``producer/session.py``, ``consumer/flow/session.py``), so only "session" followed by a
number counts. Benchmark results cite their date and commit instead (docs/performance.md).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_TEXT_SUFFIXES = (".py", ".md", ".toml", ".yaml", ".json", ".service", ".target", ".env", ".cfg", ".txt")
_HISTORY = {
    "a development session": re.compile(r"\bsessions? \d+", re.IGNORECASE),
    "an issue or task number": re.compile(r"\b(?:issue|task|ticket)s? #?\d+\b|#\d{2,}\b", re.IGNORECASE),
    "a result file named by session": re.compile(r"[\w-]-s\d+[a-z]?\.(?:json|png|csv|txt)\b"),
    "a narrated change": re.compile(
        r"\bused to\b|\bpreviously\b|\bas before\b|\bas it always did\b|\bthe old (?:rule|name|default|format)\b"
        r"|\bolder (?:producers?|consumers?|probes?|probe output|peers?|versions?)\b(?! epoch)"
        r"|\bno longer (?:computes|computed|copies|sends|does|needs|uses)\b"
        r"|\b(?:before|after) this (?:change|work|commit|branch)\b|\bthis branch\b|\bthe issue(?:'s)?\b"
        r"|\bbefore [\w`. -]{1,40} existed\b",
        re.IGNORECASE,
    ),
    "a timing diary": re.compile(r"\(?\bwas \d[\d.,]* ?(?:s|ms|min|MB|GB|%)(?=[\s).,;:]|$)"),
    "a development crew": re.compile(r"\bother (?:agents|engineers)\b|\bagents' ", re.IGNORECASE),
}
_SESSION_FILE = re.compile(r"(?:^|[-_])s\d+[a-z]?$")  # a file stem ending like bench-run-s12


def _tracked() -> list[str]:
    this = Path(__file__).resolve().relative_to(REPO).as_posix()  # it spells out every pattern
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [name for name in out.split() if name != this]


def _history_in(text: str, where: str) -> list[str]:
    """``where:LINE: what`` for every line of ``text`` that narrates development history."""
    hits = []
    for number, line in enumerate(text.splitlines(), start=1):
        hits += [
            f"{where}:{number}: {what}: {line.strip()[:120]}"
            for what, pattern in _HISTORY.items()
            if pattern.search(line)
        ]
    return hits


def _session_named(names: list[str]) -> list[str]:
    return [name for name in names if _SESSION_FILE.search(Path(name).stem)]


def test_no_tracked_file_narrates_development_history() -> None:
    hits = [
        hit
        for name in _tracked()
        if name.endswith(_TEXT_SUFFIXES) and (REPO / name).is_file()
        for hit in _history_in((REPO / name).read_text(encoding="utf-8"), name)
    ]
    assert hits == []


def test_no_tracked_file_is_named_after_a_session() -> None:
    assert _session_named(_tracked()) == []


def test_the_checker_finds_each_kind_of_history_and_spares_protocol_sessions() -> None:
    planted = "\n".join(
        (
            "Measured in session 7 (bench-run-s12.json).",
            "Fixes issue #41; the producer used to copy twice.",
            "older producers send none",
            "the receive path was 4.8 ms",
            "The ProducerSession decides; producer/session.py is pure; a page the file no longer has.",
            "melfeed no longer copies the batch",
            "a run.json from before the key existed",
        )
    )
    kinds = [hit.split(": ")[1] for hit in _history_in(planted, "x.md")]
    assert kinds == [
        "a development session",
        "a result file named by session",
        "an issue or task number",
        "a narrated change",
        "a narrated change",
        "a timing diary",
        "a narrated change",
        "a narrated change",
    ]
    assert [hit.split(":")[1] for hit in _history_in(planted, "x.md")] == ["1", "1", "2", "2", "3", "4", "6", "7"]
    assert _session_named(
        [
            "docs/bench-eff-s7a.json",
            "docs/results/throughput-2026-11-24.json",
            "producer/session.py",
            "consumer/flow/session.py",
        ]
    ) == ["docs/bench-eff-s7a.json"]
