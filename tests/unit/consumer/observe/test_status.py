"""``melfeed status`` against a hostile answer: a real REP socket in a thread answers what the test says.

Whoever answers at the control endpoint chose the reply: a partial snapshot is one line and exit 1, never
a traceback; strings with ESC or newlines reach the table escaped; ``--json`` stays JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from melfeed.consumer.observe.snapshot import field_names
from melfeed.consumer.observe.status import format_status, main_status, snapshot_problem
from tests.fakes import gpu_row, metrics_snapshot, producer_row

_EVIL = "evil\nINFO forged\x1b[2J\x1b]0;title\x07"
_EVIL_SHOWN = "evil\\nINFO forged\\x1b[2J\\x1b]0;title\\x07"


@contextlib.contextmanager
def _answering(endpoint: str, reply: bytes) -> Iterator[None]:
    """A REP socket at ``endpoint`` answering every request with ``reply`` until the block ends."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            if sock.poll(50):  # bounded, so the thread sees `done`; not a wait for the client
                sock.recv()
                sock.send(reply)

    thread = threading.Thread(target=serve, name="fake-control", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(10.0)
        sock.close(0)
        ctx.term()


def _status(
    endpoint: str,
    reply: bytes,
    capsys: pytest.CaptureFixture[str],
    *,
    as_json: bool = False,
) -> tuple[int, str, str]:
    args = argparse.Namespace(endpoint=endpoint, timeout_s=20.0, json=as_json, output=None, config=None, tf_config=None)
    with _answering(endpoint, reply):
        rc = main_status(args)
    out, err = capsys.readouterr()
    return rc, out, err


def _evil_snapshot() -> dict[str, Any]:
    return metrics_snapshot(
        1.0,
        phase=_EVIL,
        jit_compile=_EVIL,
        producers_benched=[_EVIL],
        rejects={_EVIL: 3},
        outputs={_EVIL: 0.5},
        queue_depth_hist=[0, 1],
        producers=[producer_row(_EVIL, batches=1, batches_per_s=1.0, read_ms=1.0, assemble_ms=None, send_ms=1.0)],
        gpus=[gpu_row(_EVIL, 0, util_pct=50.0, mem_used_mib=1.0, mem_total_mib=2.0, power_w=None)],
    )


def test_a_partial_snapshot_is_one_line_and_exit_1(endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _status(endpoint, json.dumps({"t_unix_s": 1.0, "phase": "training"}).encode(), capsys)
    assert (rc, out) == (1, "")
    assert err == f"melfeed status: {endpoint}: malformed snapshot: uptime_s: missing\n"


def test_a_wrongly_typed_entry_names_its_place_escaped(endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    snap = metrics_snapshot(1.0, rejects={"CRC\x1b[2J": "many"})
    rc, _, err = _status(endpoint, json.dumps(snap).encode(), capsys)
    assert rc == 1 and "\x1b" not in err and err.count("\n") == 1
    assert err.endswith("malformed snapshot: rejects[CRC\\x1b[2J]: must be an integer, got a string\n")


@pytest.mark.parametrize("reply", [b"[1, 2]", b"\xff\xfe", b"[" * 100_000, b'"phase"'])
def test_an_answer_that_is_no_json_object_is_one_line_and_exit_1(
    endpoint: str, reply: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = _status(endpoint, reply, capsys)
    assert (rc, out) == (1, "") and err == f"melfeed status: the answer from {endpoint} is not a snapshot\n"


def test_peer_strings_reach_the_table_escaped(endpoint: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _status(endpoint, json.dumps(_evil_snapshot()).encode(), capsys)
    assert (rc, err) == (0, "")
    assert "\x1b" not in out and "\x07" not in out
    assert not any(line.startswith("INFO forged") for line in out.splitlines())
    for shown in (
        f"{_EVIL_SHOWN}, step 120/300",  # phase
        f"{_EVIL_SHOWN} 0.5000; compiled with {_EVIL_SHOWN}",  # an output's name, jit_compile
        f"benched (let leases expire in a row; no leases for now): {_EVIL_SHOWN}",
        # a reject code and a GPU's role are cut at 32 characters, never inside an escape
        "rejects: evil\\nINFO forged\\x1b[2J\\x1b]... 3",
        "\nevil\\nINFO forged\\x1b[2J\\x1b]...:0 ",
    ):
        assert shown in out, shown
    assert any(line.startswith(_EVIL_SHOWN + " ") for line in out.splitlines())  # the producer row


def test_json_output_is_the_answer_with_control_characters_escaped_by_json(
    endpoint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    partial = {"phase": _EVIL}  # --json does not check the schema
    for snap in (_evil_snapshot(), partial):
        rc, out, err = _status(endpoint, json.dumps(snap).encode(), capsys, as_json=True)
        assert (rc, err) == (0, "") and json.loads(out) == snap
        assert "\x1b" not in out and "\x07" not in out and "INFO forged" in out.replace("\\n", "\n")
        assert not any(line.startswith("INFO forged") for line in out.splitlines())


@pytest.mark.parametrize("key", field_names())
def test_every_key_of_the_schema_is_required(key: str) -> None:
    snap = _evil_snapshot()
    del snap[key]
    assert snapshot_problem(snap) == f"{key}: missing"


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"step": True}, "step: must be an integer, got a boolean"),
        ({"uptime_s": None}, "uptime_s: must be a number, got null"),
        ({"loss": "0.5"}, "loss: must be a number or null, got a string"),
        ({"phase": 3}, "phase: must be a string, got an integer"),
        ({"world": "2"}, "world: must be an integer, got a string"),
        ({"steps_total": 1.5}, "steps_total: must be an integer or null, got a number"),
        ({"queue_depth_hist": [0, 1.5]}, "queue_depth_hist[1]: must be an integer, got a number"),
        ({"producers": [{"id": "p"}]}, "producers[0].batches: missing"),
        ({"producers": ["p"]}, "producers[0]: must be an object, got a string"),
        ({"gpus": {}}, "gpus: must be an array, got an object"),
        ({"gpus": [gpu_row(util_pct=None)]}, "gpus[0].util_pct: must be a number, got null"),
        ({"gpus": [gpu_row(uuid=None)]}, "gpus[0].uuid: must be a string, got null"),
        ({"outputs": {"loss": [1]}}, "outputs[loss]: must be a number or null, got an array"),
        ({"producers_benched": [1]}, "producers_benched[0]: must be a string, got an integer"),
    ],
)
def test_a_wrong_type_is_named(change: dict[str, Any], problem: str) -> None:
    assert snapshot_problem(metrics_snapshot(1.0, **change)) == problem


_VALUES: tuple[Any, ...] = (
    None,
    True,
    0,
    -1,
    2,
    1.5,
    float("nan"),
    1e308,
    "",
    "\x1b[2J",
    [],
    [1],
    [None],
    {},
    {"k": 1},
    {"k": None},
    {"k": "v"},
    [{}],
)


@pytest.mark.parametrize("key", field_names())
def test_whatever_passes_the_check_formats_without_an_exception_or_raw_control_characters(key: str) -> None:
    base = _evil_snapshot()
    for value in _VALUES:
        entries = [base | {key: value}]
        for inner in ("producers", "gpus"):
            if key == inner:
                continue
            for field in base[inner][0]:
                entries.append(base | {inner: [base[inner][0] | {field: value}]})
        for snap in entries:
            if snapshot_problem(snap) is None:
                table = format_status(snap, "ipc:///x")
                assert all(line.isprintable() for line in table.split("\n")), (key, value)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        ({"timeout_s": float("nan")}, "--timeout-s: must be a number of seconds in (0, 3600]"),
        ({"timeout_s": -1.0}, "--timeout-s: must be a number of seconds"),
        ({"timeout_s": 1e20}, "--timeout-s: must be a number of seconds"),
        ({"endpoint": "foo"}, "--endpoint: must be ipc://PATH or tcp://HOST:PORT"),
        ({"endpoint": "tcp://127.0.0.1"}, "--endpoint: must be tcp://HOST:PORT"),
        ({"endpoint": "tcp://*:5555"}, "--endpoint: cannot ask tcp://*:5555: Invalid argument"),  # libzmq's refusal
        ({"endpoint": "tcp://bad host:5555"}, "--endpoint: cannot ask tcp://bad host:5555: Invalid argument"),
    ],
)
def test_bad_flags_are_refused_before_asking_anyone(flags: dict[str, Any], needle: str) -> None:
    from melfeed.shared.errors import ConfigError

    args = argparse.Namespace(
        **{
            "endpoint": None,
            "timeout_s": 2.0,
            "json": False,
            "output": None,
            "config": None,
            "tf_config": None,
            **flags,
        }
    )
    with pytest.raises(ConfigError) as info:
        main_status(args)
    assert str(info.value).startswith(needle), str(info.value)


def test_the_default_socket_in_a_runtime_directory_of_another_user_is_never_asked(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import os

    from melfeed.shared.errors import ConfigError

    runtime = tmp_path / "melfeed"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    args = argparse.Namespace(endpoint=None, timeout_s=20.0, json=False, output=None, config=None, tf_config=None)
    with _answering(f"ipc://{runtime}/melfeed-control.sock", json.dumps(metrics_snapshot(0.0)).encode()):
        assert main_status(args) == 0  # our own directory: answered
        if os.geteuid() == 0:
            os.chown(runtime, 65534, -1)
        else:
            me = os.geteuid() + 1
            monkeypatch.setattr(os, "getuid", lambda: me)
        with pytest.raises(ConfigError, match="runtime directory belongs to another user"):
            main_status(args)  # someone else's: never asked
    assert "consumer ipc://" in capsys.readouterr().out
