"""Peer-supplied text made safe to log or show: one line, no control or escape characters, bounded.

Producer ids, ERR/BYE reasons and anything else from a HELLO are chosen by the peer. Written as they
are, a newline forges a log line (``evil\\nINFO forged``), an ANSI sequence (``\\x1b[2J``) rewrites the
operator's terminal, and a megabyte id floods the journal (docs/design.md, invariant 7).
Invariant: the result holds only printable characters, has at most ``max_chars`` characters, and is
unchanged by a second pass (escapes are printable), so escaping at the source and again where the
text is shown is harmless.
"""

from __future__ import annotations

__all__ = ["MAX_SHOWN_CHARS", "escape_line"]

MAX_SHOWN_CHARS = 200  # one log line; ids and reasons past this are cut (with a marker)
_CUT = "..."


def escape_line(text: str, max_chars: int = MAX_SHOWN_CHARS) -> str:
    """``text`` on one line: control, format and other unprintable characters as ``repr`` escapes.

    Printable non-ASCII (``é``) is kept. Longer results are cut to ``max_chars`` and end with ``...``.

    Args:
        text: any string (a non-string is shown through ``str``).
        max_chars: the longest result, ``>= 4``.
    """
    if max_chars < len(_CUT) + 1:
        raise ValueError("max_chars must leave room for text and the cut marker")
    out: list[str] = []
    used = 0
    for ch in str(text):
        piece = ch if ch.isprintable() else repr(ch)[1:-1]
        if used + len(piece) > max_chars:
            while out and used + len(_CUT) > max_chars:  # room for the marker
                used -= len(out.pop())
            return "".join(out) + _CUT
        out.append(piece)
        used += len(piece)
    return "".join(out)
