"""A failure of the user's step as the one line an operator reads: the op, the user's line, the reason.

Role: ``describe_tf_error`` turns a TensorFlow error (a program failing while it runs or compiles, or an
exception raised while user code is traced) into ``op NAME (FILE:LINE): reason`` or ``Type: reason (FILE:LINE)``;
``describe_exception`` does the same for a Python exception of user code (a step factory).

Which line is "the reason": Keras and AutoGraph wrap the original message in text of their own ("Exception
encountered when calling ...", "in user code:" and its frames, the "Arguments received by ..." list, ANSI bold),
and TensorFlow appends the op's stack and ``[[{{node ...}}]]``; those lines are dropped and the rest is joined.
The op is the longest node name TensorFlow gives (its scope names the layer, and the loop or function it sits in).

Which line is "yours" (``is_user_file``): the innermost frame whose file is none of these: not a real file
(``<frozen ...>``, AutoGraph's generated ``__autograph_generated_file*.py``), the standard library, a
``site-packages`` / ``dist-packages`` directory, melfeed's own package directories, or a package installed
into another directory on ``sys.path`` (``pip install --target DIR`` on ``PYTHONPATH``: DIR holds that
distribution's ``*.dist-info``, whose files name the package). A project installed in editable mode keeps its
``*.dist-info`` in site-packages, not next to its code, so its code stays the user's. When no frame is the
user's, the innermost frame is named.
Invariants: the result is one line of at most ``MAX_LINE_CHARS``; when it is cut, the reason is cut, never
the op or the location. Nothing here imports TensorFlow.
Shutdown: nothing to release.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
import sys
import sysconfig
import traceback
from collections.abc import Sequence
from pathlib import Path

__all__ = ["MAX_LINE_CHARS", "describe_exception", "describe_tf_error", "is_user_file", "reason_text"]

MAX_LINE_CHARS = 300  # one readable log line, even for a long TensorFlow message

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NODE = re.compile(r"\{\{node ([^}]+)\}\}|Detected at node '?([^' ]+?)'? defined at")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_TYPED = re.compile(r"([A-Za-z_][\w.]*(?:Error|Exception|Exit|Warning|Interrupt|Unavailable)): ?(.*)")
_WRAPPER = ("Exception encountered when calling ", "Graph execution error:", "in user code:")
_END = ("Arguments received by ", "Call arguments received by ", "Stack trace for op definition", "[[")
_PACKAGE_DIRS = frozenset({"site-packages", "dist-packages"})
_GENERATED = "__autograph_generated_file"


def describe_tf_error(err: BaseException) -> str:
    """One line for a TensorFlow error (or an exception from user code traced by ``tf.function``).

    An op error (``err.message``) names its node: ``op NAME (FILE:LINE): reason``, the location being the
    user's innermost frame among those TensorFlow lists ("defined at", "Stack trace for op definition").
    A trace-time error arrives wrapped by AutoGraph ("in user code:", the frames, then the original
    ``Type: message``): ``Type: reason (FILE:LINE)``.
    """
    message = getattr(err, "message", None)
    text = _ANSI.sub("", message if isinstance(message, str) else str(err))
    lines = [line.strip() for line in text.splitlines()]
    frames = _frames_in(lines)
    where = f" ({code_location([(p, n) for _, p, n in frames])})" if frames else ""
    if isinstance(message, str):
        after = frames[-1][0] + 1 if frames and lines[0].startswith("Graph execution error") else 0
        op = _op_name(text)
        reason = reason_text(lines[after:]) or type(err).__name__
        return _fit(f"op {op}{where}: " if op else "", reason, "" if op else where)
    tail = lines[frames[-1][0] + 1 :] if frames else lines
    kind, body = type(err).__name__, tail
    for i, line in enumerate(tail if frames else ()):
        match = _TYPED.fullmatch(line)
        if match is not None:  # AutoGraph's copy of the original exception: "Type: message"
            kind, body = match.group(1), [match.group(2), *tail[i + 1 :]]
            break
    reason = reason_text(body)
    return _fit(f"{kind}: " if reason else kind, reason, where)


def describe_exception(err: BaseException) -> str:
    """One line for an exception raised by user code (a step factory): ``Type: reason (FILE:LINE)``.

    The traceback starts at the frame that caught ``err`` (the caller of the user's code), so that frame is left
    out: an error of the call itself (a factory that takes no argument) names no line.
    """
    frames = [(f.filename, f.lineno or 0) for f in traceback.extract_tb(err.__traceback__)[1:]]
    reason = reason_text(_ANSI.sub("", str(err)).splitlines())
    where = f" ({code_location(frames)})" if frames else ""
    return _fit(f"{type(err).__name__}: " if reason else type(err).__name__, reason, where)


def reason_text(lines: Sequence[str]) -> str:
    """The informative lines of a message, joined by spaces: wrappers' preambles, empty lines and everything
    from an argument list, TensorFlow's op stack or its ``[[...]]`` node lines on are dropped."""
    kept = []
    for raw in lines:
        line = _ANSI.sub("", raw).strip()
        if line.startswith(_END):
            break
        if line and not line.startswith(_WRAPPER):
            kept.append(line)
    return " ".join(kept)


def _op_name(text: str) -> str | None:
    """The longest node name in ``text`` (most scope components: the layer and loop it sits in)."""
    names = [a or b for a, b in _NODE.findall(text)]
    return max(names, key=lambda name: name.count("/")) if names else None


def _fit(head: str, reason: str, tail: str) -> str:
    """``head + reason + tail`` in ``MAX_LINE_CHARS``: the reason is what gets cut."""
    room = MAX_LINE_CHARS - len(head) - len(tail)
    if len(reason) > room:
        reason = reason[: max(0, room - 3)] + "..."
    return (head + reason + tail)[:MAX_LINE_CHARS]


def _frames_in(lines: Sequence[str]) -> list[tuple[int, str, int]]:
    """(index, file, line number) of each ``File "...", line N`` among ``lines``."""
    found = ((i, _FRAME.match(line)) for i, line in enumerate(lines))
    return [(i, m.group(1), int(m.group(2))) for i, m in found if m is not None]


def code_location(frames: Sequence[tuple[str, int]]) -> str:
    """``FILE:LINE`` of the innermost frame of the user's code (``is_user_file``), else of the innermost frame."""
    shown = [(_absolute(path), line) for path, line in frames]
    own = [f for f in shown if is_user_file(f[0])]
    path, line = (own or shown)[-1]
    return f"{path}:{line}"


def _absolute(path: str) -> str:
    """TensorFlow's op stacks print absolute paths without their leading ``/``: put it back when that names a file."""
    return "/" + path if not os.path.isabs(path) and os.path.isfile("/" + path) else path


@functools.lru_cache(maxsize=4096)
def is_user_file(path: str) -> bool:
    """Whether a frame in ``path`` is the user's code, not a library's (the rule: module docstring)."""
    if path.startswith("<") or os.path.basename(path).startswith(_GENERATED):
        return False
    resolved = os.path.realpath(path)
    if _PACKAGE_DIRS.intersection(Path(resolved).parts):
        return False
    if any(_is_under(resolved, root) for root in _library_roots()):
        return False
    return not _installed_elsewhere(resolved)


def _is_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[str, ...]:
    """The standard library's directories and melfeed's own package directories."""
    roots = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib")}
    for name in ("melfeed", "melfeed.consumer", "melfeed.shared", "melfeed.producer"):
        spec = importlib.util.find_spec(name)  # melfeed.producer is located, never imported here
        if spec is not None and spec.submodule_search_locations:
            roots.update(spec.submodule_search_locations)
    return tuple(sorted(os.path.realpath(r) for r in roots))


def _installed_elsewhere(path: str) -> bool:
    """``path`` is inside a package that a ``*.dist-info`` in its own ``sys.path`` entry installed there."""
    for entry in sys.path:
        root = os.path.realpath(entry or os.getcwd())
        if _is_under(path, root) and path != root:
            top = Path(os.path.relpath(path, root)).parts[0]
            if top.removesuffix(".py") in _installed_tops(root):
                return True
    return False


@functools.lru_cache(maxsize=256)
def _installed_tops(entry: str) -> frozenset[str]:
    """Top-level names (packages, modules) of the distributions whose ``*.dist-info`` lies in ``entry``."""
    tops: set[str] = set()
    try:
        for dist in importlib.metadata.distributions(path=[entry]):
            for file in dist.files or ():
                first = file.parts[0] if file.parts else ""
                if first and first != ".." and not first.endswith((".dist-info", ".data")):
                    tops.add(first.removesuffix(".py"))
    except OSError:  # an unreadable directory on sys.path: nothing known to be installed there
        pass
    return frozenset(tops)
