"""``melfeed status``: ask a running consumer for its latest snapshot and print it.

Role: the client side of consumer/observe/control.py. The endpoint is ``--endpoint`` (the control
endpoint itself), else the one ``--config`` implies (``consumer.control_endpoint``, or derived
from ``transport.endpoint``, or the private runtime directory; ``melfeed.shared.service.lifecycle``).
Every try uses a fresh REQ socket (a REQ that timed out cannot be reused) with RCVTIMEO,
SNDTIMEO and LINGER 0, so the command never outlives ``--timeout-s`` by more than a moment.
Exit codes: 0 printed; 1 nobody answered or the answer was not a snapshot (one line on stderr);
78 a bad ``--config``, ``--endpoint`` (also one libzmq cannot connect to) or ``--timeout-s``. Imports neither
TensorFlow nor the consumer's data path.
Trust: whoever answers at the endpoint chose the reply (a stale socket path may now belong to someone
else). The table is printed only from a JSON object that has every field of the schema with its type
(``observe/snapshot.py`` ``snapshot_problem``; else ``malformed snapshot: KEY: REASON`` and exit 1), and every
string in it goes through ``escape_line``, so a reply can neither crash the command nor reach the terminal as an
escape sequence. ``--json`` prints any JSON object re-encoded by ``json.dumps``, which writes control
characters (and all non-ASCII) as ``\\uXXXX`` escapes; it does not check the schema.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import zmq

from melfeed.consumer.observe.snapshot import snapshot_problem
from melfeed.shared.config import resolve_runtime_dir
from melfeed.shared.config.checks import check_endpoint
from melfeed.shared.errors import ConfigError
from melfeed.shared.flag_checks import check_output_file
from melfeed.shared.output_files import write_output
from melfeed.shared.printable import escape_line
from melfeed.shared.service.cli import loaded_config
from melfeed.shared.service.lifecycle import check_runtime_dir, resolve_control_endpoint
from melfeed.shared.service.rank_defaults import with_rank_defaults
from melfeed.shared.service.tf_config import resolve_worker_place

__all__ = ["main_status", "ask_status", "format_status", "snapshot_problem"]

_TRIES = 2  # the timeout is split between them: a consumer that is just binding gets a second ask
_MAX_REPLY_BYTES = 16 << 20  # a snapshot is a few kB; refuse anything absurd


def ask_status(endpoint: str, timeout_s: float) -> bytes | None:
    """The raw reply of the consumer at ``endpoint``, or ``None`` if none came within ``timeout_s``."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try_ms = max(1, int(timeout_s * 1000 / _TRIES))
    try:
        for _ in range(_TRIES):
            sock = ctx.socket(zmq.REQ)
            for opt, value in (
                (zmq.LINGER, 0),
                (zmq.RCVTIMEO, try_ms),
                (zmq.SNDTIMEO, try_ms),
                (zmq.MAXMSGSIZE, _MAX_REPLY_BYTES),
            ):
                sock.setsockopt(opt, value)
            try:
                sock.connect(endpoint)
                sock.send(b"status")
                return sock.recv()
            except zmq.Again:
                continue
            finally:
                sock.close(0)
        return None
    finally:
        ctx.term()


_MAX_TIMEOUT_S = 3600.0


def main_status(args: argparse.Namespace) -> int:
    """Print the snapshot; 0 on success, 1 when no consumer (or no snapshot) answered.

    Raises:
        ConfigError: a bad ``--timeout-s`` or ``--endpoint``, or a runtime directory another user could
            have put a socket in (the default endpoint): nobody else's answer is ever printed as ours.
    """
    if not (isinstance(args.timeout_s, float) and 0 < args.timeout_s <= _MAX_TIMEOUT_S):
        raise ConfigError(
            f"must be a number of seconds in (0, {_MAX_TIMEOUT_S:.0f}]", path=("--timeout-s",), got=args.timeout_s
        )
    check_output_file(args.output, "--output")  # before asking, not after the answer
    if args.endpoint:
        check_endpoint(args.endpoint, ("--endpoint",))
        if not args.endpoint.startswith(("ipc://", "tcp://")):
            raise ConfigError("must be ipc://PATH or tcp://HOST:PORT", path=("--endpoint",), got=args.endpoint)
    endpoint = args.endpoint or _control_endpoint(args)
    try:
        raw = ask_status(endpoint, args.timeout_s)
    except zmq.ZMQError as err:  # an address libzmq refuses to connect to (tcp://*:5555, a space in the host)
        raise ConfigError(
            f"cannot ask {endpoint}: {err.strerror}",
            path=("--endpoint",) if args.endpoint else ("consumer", "control_endpoint"),
        ) from None
    if raw is None:
        print(f"melfeed status: no consumer answered at {endpoint} within {args.timeout_s:.1f} s", file=sys.stderr)
        return 1
    try:
        snap = json.loads(raw)
        if not isinstance(snap, dict):
            raise ValueError("not an object")
    except (ValueError, RecursionError):  # RecursionError: nested too deep to parse
        print(f"melfeed status: the answer from {endpoint} is not a snapshot", file=sys.stderr)
        return 1
    problem = None if args.json else snapshot_problem(snap)
    if problem is not None:
        print(f"melfeed status: {endpoint}: malformed snapshot: {problem}", file=sys.stderr)
        return 1
    if args.output:
        try:
            write_output(args.output, json.dumps(snap, indent=2) + "\n", what="--output")
        except OSError as err:  # checked before asking; a full disk is still one line
            print(f"melfeed status: {args.output}: cannot write: {err.strerror or err}", file=sys.stderr)
            return 1
    print(json.dumps(snap, indent=2) if args.json else format_status(snap, endpoint))
    return 0


def _control_endpoint(args: argparse.Namespace) -> str:
    """The control socket the consumer of ``--config`` (and of this rank, in a job) binds."""
    cfg = loaded_config(args)
    place = resolve_worker_place(getattr(args, "tf_config", None), os.environ)
    cfg = with_rank_defaults(cfg, place, os.environ, create_dir=False)
    endpoint = resolve_control_endpoint(cfg, os.environ, create_dir=False)
    runtime = resolve_runtime_dir(os.environ)
    if endpoint.startswith(f"ipc://{runtime}/") and os.path.lexists(runtime):
        check_runtime_dir(runtime)  # another user's /tmp/melfeed-UID could serve any answer
    return endpoint


def _f(value: Any, fmt: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{fmt}}{unit}"


def _outputs(outputs: dict[str, float | None]) -> str:
    return ", ".join(f"{escape_line(name, 64)} {_f(value, '.4f')}" for name, value in outputs.items()) or "-"


def format_status(snap: dict[str, Any], endpoint: str) -> str:
    """The human table: overall figures, one row per producer, one per GPU, rejects by code.

    ``snap`` passed ``snapshot_problem``; every string in it is the answering peer's and is escaped.
    """
    total = f"/{snap['steps_total']}" if snap["steps_total"] else ""
    mb_s = None if snap["bytes_per_s"] is None else snap["bytes_per_s"] / 1e6
    rank = f", rank {snap['rank']} of {snap['world']}" if snap["world"] > 1 else ""
    lines = [
        f"consumer {endpoint}{rank}: {escape_line(snap['phase'], 64)}, step {snap['step']}{total}, "
        f"loss {_f(snap['loss'], '.4f')}, up {snap['uptime_s']:.0f} s",
        f"last {snap['window_s']:.0f} s: {_f(snap['batches_per_s'], '.1f')} batches/s, "
        f"{_f(snap['samples_per_s'], '.0f')} samples/s, {_f(mb_s, '.1f')} MB/s received, "
        f"stall {_f(snap['stall_pct'], '.1f', '%')}",
        f"step p50 {_f(snap['step_p50_ms'], '.1f', ' ms')}, p99 {_f(snap['step_p99_ms'], '.1f', ' ms')}, "
        f"cv {_f(snap['step_cv'], '.2f')}, padding efficiency {_f(snap['padding_efficiency'], '.3f')}, "
        f"feed efficiency {_f(snap['feed_efficiency'], '.3f')} (fed / resident-batch steps/s), "
        f"useful work {_f(snap['useful_work'], '.3f')} (feed x padding)",
        f"queue mean {_f(snap['queue_depth_mean'], '.1f')}, by depth {snap['queue_depth_hist']}; leases "
        f"{snap['leases_outstanding']} outstanding (window {snap['lease_window']}); producers alive "
        f"{snap['producers_alive']}",
        f"step outputs (mean over the status interval): {_outputs(snap['outputs'])}; "
        f"compiled with {escape_line(snap['jit_compile'] or '-', 64)}",
        f"duplicates {snap['duplicates']}, quarantined {snap['quarantined']}, "
        f"compiles after ready {snap['compiles_after_ready']}, checkpoint failures "
        f"{snap['checkpoint_failures']}, connections cut {snap['connections_cut']}, "
        f"repeated HELLOs {snap['hello_repeats']}",
        "",
        f"{'producer':<20} {'batches':>8} {'batches/s':>10} {'read ms':>8} {'assemble ms':>12} {'send ms':>8}",
    ]
    for p in snap["producers"]:  # ids are peer-chosen: escaped (a snapshot may come from anyone)
        lines.append(
            f"{escape_line(str(p['id']), 64):<20} {_f(p['batches'], 'd'):>8} {_f(p['batches_per_s'], '.1f'):>10} "
            f"{_f(p['read_ms'], '.2f'):>8} {_f(p['assemble_ms'], '.2f'):>12} {_f(p['send_ms'], '.2f'):>8}"
        )
    if not snap["producers"]:
        lines.append("(no producer connected)")
    if snap["producers_benched"]:
        lines.append(
            "benched (let leases expire in a row; no leases for now): "
            + ", ".join(escape_line(str(x), 64) for x in snap["producers_benched"])
        )
    lines += ["", f"{'gpu':<20} {'util %':>8} {'mem used/total GiB':>20} {'power W':>8}"]
    for g in snap["gpus"]:
        mem = f"{g['mem_used_mib'] / 1024:.1f}/{g['mem_total_mib'] / 1024:.1f}"
        lines.append(
            f"{escape_line(g['role'], 32) + ':' + str(g['index']):<20} {g['util_pct']:>8.0f} {mem:>20} "
            f"{_f(g['power_w'], '.0f'):>8}"
        )
    if not snap["gpus"]:
        lines.append("n/a (no NVML, no GPU, or sampling off)")
    rejects = ", ".join(f"{escape_line(str(code), 32)} {n}" for code, n in snap["rejects"].items()) or "none"
    lines += ["", f"rejects: {rejects}"]
    return "\n".join(lines)
