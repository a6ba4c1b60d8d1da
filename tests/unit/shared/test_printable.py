"""shared/printable.py: peer-supplied text on one bounded, printable line."""

from __future__ import annotations

import pytest

from melfeed.shared.printable import MAX_SHOWN_CHARS, escape_line


def test_printable_text_is_kept_and_control_characters_are_escaped() -> None:
    assert escape_line("bad file é.npy: 'x'") == "bad file é.npy: 'x'"
    assert escape_line("a\r\nb\tc\x00\u2028") == "a\\r\\nb\\tc\\x00\\u2028"
    assert escape_line("evil\nINFO forged") == "evil\\nINFO forged"
    assert escape_line("\x1b[2J\x1b]0;title\x07\x9b31m") == "\\x1b[2J\\x1b]0;title\\x07\\x9b31m"  # ANSI, C1 CSI
    assert escape_line("\u202eevil\u200b") == "\\u202eevil\\u200b"  # bidi override, zero width


def test_every_code_point_below_0x20_and_del_is_escaped_and_nothing_unprintable_survives() -> None:
    text = "".join(chr(i) for i in (*range(0x20), 0x7F, *range(0x80, 0xA0)))
    out = escape_line(text, 10_000)
    assert out.isprintable() and "\x1b" not in out and "\n" not in out


@pytest.mark.parametrize("text", ["x" * 1000, "\x1b" * 1000, "ab\n" * 500])
def test_the_result_is_bounded_and_marks_the_cut(text: str) -> None:
    out = escape_line(text)
    assert len(out) <= MAX_SHOWN_CHARS and out.endswith("...")
    assert len(escape_line(text, 10)) <= 10
    assert escape_line("short", 10) == "short"
    with pytest.raises(ValueError):
        escape_line("x", 3)


def test_escaping_twice_changes_nothing() -> None:
    once = escape_line("evil\nINFO forged\x1b[31m")
    assert escape_line(once) == once
