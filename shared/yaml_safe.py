"""Reading a YAML config file that may be hostile: bounded, UTF-8 only, no anchors or aliases.

Role: ``read_config_file`` is the only code that turns a config file's bytes into the mapping
``melfeed.shared.config.loader.load_config`` validates. On a shared box the file can be anything, so before any
value is trusted (docs/design.md, invariant 7):

- it must be a regular file (a FIFO would block the open, ``/dev/zero`` would never end), read
  with ``O_NONBLOCK`` and at most ``MAX_CONFIG_BYTES``;
- its bytes must be UTF-8 (Latin-1, UTF-16 or binary junk name the byte offset of the first bad
  byte; a UTF-8 byte-order mark is accepted);
- YAML aliases are refused at the first one, before the composer resolves it, so an alias bomb
  ("billion laughs") never expands; plain anchors without an alias are harmless and ignored;
- a key repeated in one mapping is refused with both lines (PyYAML would keep the last one and drop the
  first one's values, typos and bad values included, without a word);
- nesting deeper than Python's recursion limit is refused, not a traceback, and so is a scalar its
  constructor cannot build (an integer past Python's 4300-digit limit, a date like 2001-13-45);
- the document must be a mapping (or empty: all defaults).

Invariant: every refusal is one ``ConfigError`` whose text starts with the file's path; never a
traceback, never a hang. Pure of globals: safe to call from any thread.
Shutdown: nothing to shut down; the descriptor is closed before returning.
"""

from __future__ import annotations

import os
import stat
from typing import Any

import yaml

from melfeed.shared.cache.filekind import OPEN_FLAGS, mode_kind, not_regular_reason
from melfeed.shared.errors import ConfigError

__all__ = ["MAX_CONFIG_BYTES", "read_config_file", "read_text_file", "read_value"]

MAX_CONFIG_BYTES = 1 << 20  # example.yaml with every key is ~6 KiB; anything near 1 MiB is not a config
_BOMS = {b"\xff\xfe": "UTF-16 little-endian", b"\xfe\xff": "UTF-16 big-endian"}


class _AliasFound(Exception):
    def __init__(self, name: str, line: int) -> None:
        super().__init__(name, line)
        self.name, self.line = name, line


class _DuplicateKey(Exception):
    def __init__(self, key: str, line: int, first_line: int) -> None:
        super().__init__(key, line, first_line)
        self.key, self.line, self.first_line = key, line, first_line


class _NoAliasLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML is untyped
    """``SafeLoader`` that stops at the first alias event, before the composer resolves it, and at the
    first key repeated in one mapping (PyYAML keeps the last silently, dropping the first one's values)."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _AliasFound(str(event.anchor), event.start_mark.line + 1)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            first_line: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    if key in first_line:
                        raise _DuplicateKey(str(key), key_node.start_mark.line + 1, first_line[key])
                    first_line[key] = key_node.start_mark.line + 1
                except TypeError:  # an unhashable key: the constructor refuses it below
                    continue
        return super().construct_mapping(node, deep)


def _fail(path: str | os.PathLike[str], message: str) -> ConfigError:
    return ConfigError(message, path=(str(path),))


def _read_bounded(path: str | os.PathLike[str]) -> bytes:
    """The file's bytes: a regular file of at most ``MAX_CONFIG_BYTES``, opened without blocking."""
    try:
        fd = os.open(path, OPEN_FLAGS)
    except OSError as err:
        raise _fail(path, f"cannot read config file: {err.strerror}") from err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _fail(path, not_regular_reason(mode_kind(st.st_mode)))
        if st.st_size > MAX_CONFIG_BYTES:
            raise _fail(path, f"config file is {st.st_size} bytes, larger than the {MAX_CONFIG_BYTES} allowed")
        chunks, have = [], 0
        while have <= MAX_CONFIG_BYTES:  # bounded even if the file grows while it is read
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - have)
            if not chunk:
                break
            chunks.append(chunk)
            have += len(chunk)
    except OSError as err:
        raise _fail(path, f"cannot read config file: {err.strerror}") from err
    finally:
        os.close(fd)
    if have > MAX_CONFIG_BYTES:
        raise _fail(path, f"config file grew past the {MAX_CONFIG_BYTES} bytes allowed while being read")
    return b"".join(chunks)


def _decode(data: bytes, path: str | os.PathLike[str]) -> str:
    """``data`` as UTF-8; otherwise one line with the offset of the first byte that is not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        hint = next((f" (a {name} byte-order mark)" for bom, name in _BOMS.items() if data.startswith(bom)), "")
        raise _fail(
            path, f"not UTF-8: byte 0x{data[err.start]:02x} at byte offset {err.start}{hint}; save the file as UTF-8"
        ) from None


def _parse(text: str, path: str | os.PathLike[str]) -> Any:
    try:
        return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506  # SafeLoader subclass
    except _DuplicateKey as dup:
        raise _fail(
            path,
            f"key {dup.key!r} at line {dup.line} repeats the one at line {dup.first_line} of the "
            "same mapping: write each key once",
        ) from None
    except _AliasFound as found:
        raise _fail(
            path,
            f"YAML alias *{found.name} at line {found.line}: anchors and aliases are not "
            "allowed in config files (write the value out)",
        ) from None
    except yaml.reader.ReaderError as err:  # a control character: valid UTF-8 that YAML refuses
        offset = len(text[: err.position].encode("utf-8"))
        raise _fail(
            path, f"invalid YAML: character U+{err.character:04X} at byte offset {offset} is not allowed"
        ) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None)
        raise _fail(path, f"invalid YAML{where}" + (f": {problem}" if problem else "")) from err
    except RecursionError:
        raise _fail(path, "invalid YAML: nested too deeply") from None
    except (ValueError, OverflowError) as err:  # a scalar its constructor refuses: a 5000-digit int, 2001-13-45
        raise _fail(path, f"invalid YAML: a value cannot be read: {err}") from None


def read_text_file(path: str | os.PathLike[str]) -> str:
    """A small text file read under the same rules as a config file (regular, bounded, strict UTF-8).

    Raises:
        ConfigError: one line starting with the path (``--tf-config FILE`` uses it too).
    """
    return _decode(_read_bounded(path), path)


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """Read, check and parse one YAML config file (see the module docstring for the rules).

    Returns:
        The top-level mapping, or ``None`` for an empty document (all defaults).

    Raises:
        ConfigError: The file cannot be read, is not a regular file, is larger than
            ``MAX_CONFIG_BYTES``, is not UTF-8, uses an alias, is not valid YAML, or its top level
            is not a mapping. One line, starting with the path.
    """
    doc = _parse(_decode(_read_bounded(path), path), path)
    if doc is not None and not isinstance(doc, dict):
        raise _fail(
            path, f"the top level must be a mapping (key: value lines), got a value of type {type(doc).__name__}"
        )
    return doc


def read_value(text: str, key: str) -> Any:
    """One value as a config file would hold it (a YAML scalar or flow: ``null``, ``16``, ``"0"``, ``[1, 2]``),
    under the same rules (no aliases, no repeated keys).

    Raises:
        ConfigError: ``text`` is no valid YAML value; one line starting with ``key``.
    """
    return _parse(text, key)
