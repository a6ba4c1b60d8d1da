"""Checks by class that every config value passes, whatever its key (docs/reference/exit-codes.md, 78).

Role: the refusals that are the same for many keys, so that no key can forget one:

- every float is finite (YAML ``.nan`` and ``.inf`` are floats);
- every integer fits in a signed 64-bit word (msgpack, numpy and the plan's seed all take int64);
  frame, token and row counts fit in int32 (the wire's ``mel_len``, ``tok_len`` and token arrays);
- every string is one printable line (a NUL or newline in a path or endpoint fails far from here);
- endpoints are usable: ``ipc://PATH`` at most ``MAX_IPC_PATH_BYTES`` (the AF_UNIX limit) and
  ``tcp://HOST:PORT`` with a port in 1..65535;
- free-form settings (``model.params``) are YAML values only (``plain_params``);
- the addresses one consumer binds are distinct (``check_distinct_binds``): the data endpoint, the status
  socket and the metrics port. The second bind of one address would otherwise fail at start with a
  message about "another consumer" that is this very process.

Checks that need the machine run where the consumer starts, not at load (``deploy`` and ``status``
read configs written for other hosts): ``check_output_paths`` (``consumer`` and ``run``, before
training) and ``check_ring_bytes`` (once the manifest gives the largest batch). The rest is pure
(``endpoints_collide`` only reads where links in an ipc path lead, where they exist).
Invariant: each refusal is one ``ConfigError`` naming the key path.
Shutdown: nothing to release.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from melfeed.shared.errors import ConfigError

__all__ = [
    "require",
    "resolve_checksum",
    "check_transport_mode",
    "check_cost_setting",
    "check_planner_settings",
    "check_boundaries",
    "INT64_MAX",
    "INT32_MAX",
    "MAX_IPC_PATH_BYTES",
    "check_number",
    "check_int32",
    "check_seed",
    "check_not_abstract",
    "check_text",
    "check_endpoint",
    "check_distinct_binds",
    "check_output_paths",
    "check_ring_bytes",
    "endpoints_collide",
    "physical_memory_bytes",
    "plain_params",
]

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
MAX_IPC_PATH_BYTES = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux: longer paths cannot be bound


def require(cond: bool, message: str, path: tuple[str, ...], got: Any) -> None:
    """Raise ``ConfigError(message)`` naming ``path`` and ``got`` unless ``cond`` holds."""
    if not cond:
        raise ConfigError(message, path=path, got=got)


def check_number(value: Any, path: tuple[str, ...]) -> None:
    """Refuse a non-finite float or an integer outside the signed 64-bit range (bools pass)."""
    if isinstance(value, bool):
        return
    if isinstance(value, int) and not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ConfigError(f"must fit in a signed 64-bit integer (|value| < 2**63), got {_short_int(value)}", path=path)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError("must be a finite number", path=path, got=value)


_PARAM_SCALARS = (str, int, float, bool, type(None))


def plain_params(value: Any, path: tuple[str, ...]) -> Any:
    """A deep copy of ``model.params`` made of YAML values only (producers get the config as YAML)."""
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            require(isinstance(key, str) and bool(key), "keys must be non-empty strings", path, key)
            out[key] = plain_params(item, path + (key,))
        return out
    if isinstance(value, (list, tuple)):
        return [plain_params(item, path) for item in value]
    require(
        isinstance(value, _PARAM_SCALARS),
        "must be made of strings, numbers, booleans, null, lists and mappings",
        path,
        type(value).__name__,
    )
    check_number(value, path)
    return value


def check_int32(value: int | None, path: tuple[str, ...]) -> None:
    """Frame, token and row counts travel as int32 on the wire."""
    if value is not None and value > INT32_MAX:
        raise ConfigError(f"must be <= {INT32_MAX} (an int32 on the wire)", path=path, got=value)


def check_rows_settings(batch_size: object, rows: tuple[int, ...] | None, max_batch_size: int) -> None:
    """``buckets.batch_size`` (rows >= 1, or "auto"), ``buckets.rows`` (one count >= 1 per bucket) and
    ``buckets.max_batch_size`` (>= 1); all travel as int32."""
    p = ("buckets",)
    require(
        batch_size is None or batch_size == "auto" or type(batch_size) is int,
        "must be an integer or auto",
        p + ("batch_size",),
        batch_size,
    )
    require(type(batch_size) is not int or batch_size >= 1, "must be >= 1", p + ("batch_size",), batch_size)
    require(
        type(max_batch_size) is int and max_batch_size >= 1, "must be >= 1", p + ("max_batch_size",), max_batch_size
    )
    require(
        rows is None or (len(rows) >= 1 and all(type(r) is int and r >= 1 for r in rows)),
        "must be a list of row counts >= 1, one per bucket, or null",
        p + ("rows",),
        rows,
    )
    check_int32(batch_size if type(batch_size) is int else None, p + ("batch_size",))
    check_int32(max_batch_size, p + ("max_batch_size",))
    for r in rows or ():
        check_int32(r, p + ("rows",))


def check_planner_settings(
    token_cost: float,
    attention_cost: float,
    min_frames_per_token: float | None,
    max_frames_per_token: float | None,
    cost_tolerance: float,
) -> None:
    """The 2-D planner's cost weights and tolerance, and the frames-per-token outlier limits (``buckets.*``)."""
    p = ("buckets",)
    require(0 <= cost_tolerance <= 1, "must be in 0..1", p + ("cost_tolerance",), cost_tolerance)
    require(0 <= token_cost <= 1000, "must be in 0..1000", p + ("token_cost",), token_cost)
    require(0 <= attention_cost <= 1, "must be in 0..1", p + ("attention_cost",), attention_cost)
    lo, hi = min_frames_per_token, max_frames_per_token
    for name, v in (("max_frames_per_token", hi), ("min_frames_per_token", lo)):
        require(v is None or 0 < v <= 1e6, "must be in (0, 1e6]", p + (name,), v)
    require(lo is None or hi is None or lo <= hi, "must be <= max_frames_per_token", p + ("min_frames_per_token",), lo)


def check_cost_setting(cost: str, num_buckets: int | None, boundaries: tuple[int, ...] | None) -> None:
    """``buckets.cost``: "formula" or "measured"; measured weights shape a 2-D plan only (a 1-D plan costs frames)."""
    p = ("buckets", "cost")
    require(cost in ("formula", "measured"), "must be 'formula' or 'measured'", p, cost)
    require(
        cost == "formula" or (num_buckets is None and boundaries is None),
        "'measured' needs a 2-D plan: leave num_buckets and boundaries unset",
        p,
        cost,
    )


def check_boundaries(boundaries: tuple[int, ...] | None) -> None:
    """``buckets.boundaries``: None, or a strictly increasing list of positive frame counts (int32)."""
    if boundaries is None:
        return
    b = tuple(boundaries)
    require(
        len(b) >= 1 and all(isinstance(x, int) and x > 0 for x in b) and list(b) == sorted(set(b)),
        "must be a strictly increasing list of positive frame counts",
        ("buckets", "boundaries"),
        boundaries,
    )
    check_int32(b[-1], ("buckets", "boundaries"))


def check_seed(value: Any, path: tuple[str, ...]) -> None:
    """Seeds: an integer in 0..2**63-1 (numpy's SeedSequence and the HELLO message take any such)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT64_MAX:
        shown = _short_int(value) if isinstance(value, int) else repr(value)
        raise ConfigError(f"must be an integer in 0..2**63-1, got {shown}", path=path)


def check_text(value: str, path: tuple[str, ...]) -> None:
    """A config string is one printable line: no NUL, newline or other control character."""
    bad = next((ch for ch in value if not ch.isprintable() and ch != " "), None)
    if bad is not None:
        raise ConfigError(f"must not contain control characters (found U+{ord(bad):04X})", path=path, got=value)


def check_endpoint(endpoint: str, path: tuple[str, ...]) -> None:
    """``ipc:///ABSOLUTE/PATH`` (or ``ipc://@NAME``) that fits in a unix socket address, or ``tcp://HOST:PORT``."""
    if endpoint.startswith("ipc://"):
        address = endpoint.removeprefix("ipc://")
        if not address:
            raise ConfigError("ipc:// needs a socket path", path=path, got=endpoint)
        if not address.startswith(("/", "@")):  # relative to each process's own working directory
            raise ConfigError(
                "needs an absolute socket path (ipc:///DIR/NAME.sock): a relative one names a "
                "different file in each process's working directory",
                path=path,
                got=endpoint,
            )
        size = len(address.encode("utf-8"))
        if size > MAX_IPC_PATH_BYTES:
            raise ConfigError(
                f"socket path is {size} bytes, longer than the {MAX_IPC_PATH_BYTES} a unix socket "
                "allows; use a shorter directory",
                path=path,
                got=endpoint,
            )
    elif endpoint.startswith("tcp://"):
        host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
        if not sep or not host:
            raise ConfigError("must be tcp://HOST:PORT", path=path, got=endpoint)
        if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
            raise ConfigError("port must be in 1..65535", path=path, got=endpoint)


def check_not_abstract(endpoint: str | None, insecure: bool, path: tuple[str, ...]) -> None:
    """An abstract unix socket (``ipc://@NAME``) has no file, so no directory mode guards it: any local
    user can connect to it, or bind the name first and pose as the consumer. Only with ``transport.insecure``."""
    if endpoint is not None and endpoint.startswith("ipc://@") and not insecure:
        raise ConfigError(
            "is an abstract unix socket, which every local user can connect to or bind first; use a "
            "path (ipc:///DIR/NAME.sock) or set transport.insecure: true",
            path=path,
            got=endpoint,
        )


_ANY_HOST = frozenset({"*", "0.0.0.0", "[::]", "::", ""})  # every interface: overlaps every address
_SAME_HOST = {"localhost": "127.0.0.1", "::ffff:127.0.0.1": "127.0.0.1"}


def _host(host: str) -> str:
    """One spelling per address: ZeroMQ brackets an IPv6 host (``[::1]``), ``metrics_host`` does not (``::1``)."""
    host = host.lower().removeprefix("[").removesuffix("]")
    return _SAME_HOST.get(host, host)


def _tcp_address(endpoint: str) -> tuple[str, int] | None:
    """``(host, port)`` of ``tcp://HOST:PORT``, else ``None`` (the port as a number: ``05555`` is 5555)."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return (_host(host), int(port)) if port.isascii() and port.isdigit() else None


def _tcp_overlap(a: tuple[str, int], b: tuple[str, int]) -> bool:
    return a[1] == b[1] and (a[0] == b[0] or a[0] in _ANY_HOST or b[0] in _ANY_HOST)


def endpoints_collide(a: str, b: str) -> bool:
    """Whether binding both ``a`` and ``b`` takes one address twice: the same ipc path (resolved: links
    and ``..`` followed where they exist) or abstract name, or tcp on one port with the same host or a
    wildcard (``*``, ``0.0.0.0``, ``[::]``) on either side."""
    if a.startswith("ipc://") and b.startswith("ipc://"):
        pa, pb = a.removeprefix("ipc://"), b.removeprefix("ipc://")
        if pa.startswith("@") or pb.startswith("@"):
            return pa == pb
        return os.path.realpath(pa) == os.path.realpath(pb)
    ta, tb = _tcp_address(a), _tcp_address(b)
    return ta is not None and tb is not None and _tcp_overlap(ta, tb)


def check_distinct_binds(
    endpoints: Mapping[tuple[str, ...], str | None], http: tuple[tuple[str, ...], str, int | None] | None = None
) -> None:
    """Refuse two of the addresses one consumer binds that are the same address.

    Args:
        endpoints: key path -> endpoint the consumer binds (``None``: not bound), in the order the keys
            are named: the later key of a colliding pair is the one refused.
        http: ``(key path, host, port)`` of an HTTP listener (the metrics port; port ``None``: off).

    Raises:
        ConfigError: naming the later key and the one it collides with, e.g.
            ``consumer.control_endpoint: must differ from transport.endpoint (ipc:///run/x.sock)``.
    """
    named = [(key, value) for key, value in endpoints.items() if value is not None]
    for i, (key, value) in enumerate(named):
        for other_key, other in named[:i]:
            if endpoints_collide(other, value):
                raise ConfigError(
                    f"must differ from {'.'.join(other_key)} ({other}): the consumer binds both", path=key, got=value
                )
    key, host, port = http if http is not None else ((), "", None)
    if port is not None:
        here = (_host(host), port)
        for other_key, other in named:
            there = _tcp_address(other)
            if there is not None and _tcp_overlap(here, there):
                raise ConfigError(
                    f"{host}:{port} is also where {'.'.join(other_key)} ({other}) listens; choose another port",
                    path=key,
                )


def check_output_paths(outputs: Mapping[tuple[str, ...], str | None], endpoints: Mapping[tuple[str, ...], str]) -> None:
    """Before training: each output file's directory and each ipc socket's directory exists and is writable.

    Args:
        outputs: key path -> file the run will write (``None`` = not written), e.g. the metrics file.
        endpoints: key path -> endpoint the run will bind (tcp and abstract ipc are skipped).

    Raises:
        ConfigError: naming the key, the directory and why it cannot be used.
    """
    dirs = {key: os.path.dirname(os.path.abspath(p)) for key, p in outputs.items() if p is not None}
    for key, endpoint in endpoints.items():
        address = endpoint.removeprefix("ipc://")
        if address != endpoint and not address.startswith("@"):
            dirs[key] = os.path.dirname(os.path.abspath(address))
    for key, directory in dirs.items():
        if not os.path.isdir(directory):
            raise ConfigError(f"directory {directory} does not exist", path=key)
        if not os.access(directory, os.W_OK | os.X_OK):
            raise ConfigError(f"directory {directory} is not writable", path=key)


def physical_memory_bytes() -> int | None:
    """This machine's RAM in bytes, or ``None`` where the platform does not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return None


def check_ring_bytes(ring_slots: int, max_batch_nbytes: int, memory_bytes: int | None) -> None:
    """The ring (``ring_slots`` x the largest batch) must fit in memory; known once the buckets are built.

    Raises:
        ConfigError: naming ``buckets`` with the bytes needed and the bytes there are.
    """
    need = ring_slots * max_batch_nbytes
    if memory_bytes is not None and need > memory_bytes:
        raise ConfigError(
            f"a ring of {ring_slots} slots x the largest batch ({max_batch_nbytes} bytes) needs {need} "
            f"bytes, more than this machine's {memory_bytes}; lower buckets.batch_size (or "
            "frame_budget, max_frames) or consumer.ring_slots",
            path=("buckets",),
        )


def _short_int(value: int) -> str:
    """A huge integer by its size, not thousands of digits on one error line."""
    if value.bit_length() <= 100:
        return str(value)
    return f"an integer of about {round(value.bit_length() * math.log10(2))} digits"


def resolve_checksum(checksum: bool | None, endpoint: str, insecure: bool) -> bool:
    """Whether producers must send a crc32 of each payload (``transport.checksum``; ``None`` = decide).

    Default: only on tcp without CURVE (``transport.insecure``). Under CURVE every message carries a
    Poly1305 tag that libzmq checks before delivery, so a corrupted payload never arrives and a crc32
    (about 3 ms per 9 MB batch on each side) would only repeat that check. On ipc the bytes never
    leave the host's memory (a Unix socket, or the producer's write into the shared slot), where a
    checksum finds no corruption a memory error would not also cause elsewhere (docs/design.md,
    "Wire protocol"). ``true`` turns it on everywhere, ``false`` off everywhere.
    """
    if checksum is not None:
        return checksum
    return endpoint.startswith("tcp://") and insecure


def check_transport_mode(mode: str, endpoint: str | None) -> None:
    """``transport.mode: shm`` needs a same-host (ipc://) endpoint; tcp producers use payload frames.

    Also called once the endpoint is resolved (``--endpoint`` may override the file).
    """
    require(
        not (mode == "shm" and endpoint is not None and endpoint.startswith("tcp://")),
        f"'shm' needs an ipc:// endpoint, the endpoint is {endpoint}",
        ("transport", "mode"),
        mode,
    )
