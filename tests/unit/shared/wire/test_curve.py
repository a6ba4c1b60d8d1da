"""CURVE keys, allow-list, ZAP decisions and when CURVE is required (pure logic + key files)."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest
import zmq.utils.z85

from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import ConfigError
from melfeed.shared.wire.curve import (
    AllowList,
    client_keys_for,
    generate_keys,
    producer_id_matches,
    server_keys_for,
    zap_reply,
)
from tests.cli_run import refusal, run_cli
from tests.planted import MALLORY, needs_root, plant_dir, plant_link, sticky_dir


@pytest.mark.parametrize(
    "endpoint",
    ["tcp://127.0.0.1:5555", "tcp://localhost:5555", "tcp://[::1]:5555", "tcp://10.0.0.7:5555", "tcp://0.0.0.0:5555"],
)
def test_every_tcp_endpoint_loopback_included_needs_curve_unless_marked_insecure(
    endpoint: str, caplog: pytest.LogCaptureFixture
) -> None:
    plain = config_from_mapping({}).transport
    with pytest.raises(
        ConfigError,
        match=f"transport.curve_secret_key: is required for {re.escape(endpoint)}: tcp needs CURVE, loopback included",
    ):
        server_keys_for(plain, endpoint)
    with pytest.raises(ConfigError, match="transport.insecure: true"):
        client_keys_for(plain, endpoint)
    insecure = config_from_mapping({"transport": {"insecure": True}}).transport
    with caplog.at_level(logging.WARNING, logger="melfeed.shared.wire.curve"):
        assert server_keys_for(insecure, endpoint) is None and client_keys_for(insecure, endpoint) is None
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]  # the consumer's, once
    assert "transport.insecure" in warning.getMessage() and endpoint in warning.getMessage()


def test_ipc_needs_no_curve_and_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    plain = config_from_mapping({}).transport
    with caplog.at_level(logging.WARNING):
        assert server_keys_for(plain, "ipc:///run/melfeed/melfeed.sock") is None
    assert caplog.records == []


def test_keys_are_written_once_with_private_secrets_and_load_as_an_allow_list(tmp_path: Path) -> None:
    written = generate_keys(tmp_path / "k", ["hostA", "hostB"])
    assert {p.name for p in written} == {
        "consumer.key",
        "consumer.key_secret",
        "hostA.key",
        "hostA.key_secret",
        "hostB.key",
        "hostB.key_secret",
    }
    assert oct(os.stat(tmp_path / "k" / "producers" / "hostA.key_secret").st_mode & 0o777) == "0o600"
    assert generate_keys(tmp_path / "k", ["hostA"]) == []  # never overwrites a key in use
    allowed = AllowList.load(tmp_path / "k" / "producers")
    assert sorted(allowed.names.values()) == ["hostA", "hostB"]


@pytest.mark.parametrize("name", ["a\nb", "", ".hidden", "-flag", "a/b", "..", "a b", "x" * 65, "caf\u00e9", "a\x00"])
def test_a_producer_name_that_is_not_a_safe_token_is_refused_before_anything_is_written(
    tmp_path: Path, name: str
) -> None:
    with pytest.raises(ConfigError, match="^--producer: must be 1..64 letters, digits") as info:
        generate_keys(tmp_path / "k", ["good", name])
    assert "\n" not in str(info.value)
    assert not (tmp_path / "k").exists()  # no key named with a newline, no half-written directory


def test_the_longest_and_oddest_safe_names_are_accepted(tmp_path: Path) -> None:
    names = ["x" * 64, "_a", "9.b-c_d"]
    generate_keys(tmp_path, names)
    assert sorted(p.name for p in (tmp_path / "producers").glob("*.key")) == sorted(f"{n}.key" for n in names)


def test_a_key_directory_that_cannot_be_made_is_one_config_error_with_the_os_reason(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=f"^{tmp_path}/afile: cannot write the keys \\(Not a directory\\)$"):
        generate_keys(tmp_path / "afile", ["a"])
    with pytest.raises(ConfigError, match=r"^/proc/melfeed-k: cannot write the keys \(No such file or directory\)$"):
        generate_keys("/proc/melfeed-k", ["a"])


def test_the_keys_command_names_a_read_only_parent_in_one_line(tmp_path: Path) -> None:
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o555)
    proc = run_cli("keys", str(parent / "k"), "--producer", "a", unprivileged=True)
    assert refusal(proc, "keys") == f"{parent / 'k'}: cannot write the keys (Permission denied)"
    proc = run_cli("keys", str(tmp_path / "k"), "--producer", "a\nb")
    assert refusal(proc, "keys").startswith("--producer: must be ") and not (tmp_path / "k").exists()


def test_zap_admits_an_allowed_curve_key_with_its_name_and_refuses_everything_else(tmp_path: Path) -> None:
    generate_keys(tmp_path, ["hostA"])
    allowed = AllowList.load(tmp_path / "producers")
    key_z85 = next(iter(allowed.names))
    raw = zmq.utils.z85.decode(key_z85)
    ok = zap_reply([b"1.0", b"7", b"melfeed", b"1.2.3.4", b"", b"CURVE", raw], allowed)
    assert ok[2:5] == [b"200", b"OK", b"hostA"] and ok[1] == b"7"
    assert zap_reply([b"1.0", b"8", b"melfeed", b"", b"", b"CURVE", bytes(32)], allowed)[2:4] == [
        b"400",
        b"unknown key",
    ]
    assert zap_reply([b"1.0", b"9", b"melfeed", b"", b"", b"NULL"], allowed)[2:4] == [b"400", b"CURVE required"]
    assert zap_reply([b"2.0", b"9", b"", b"", b"", b"CURVE", raw], allowed)[2] == b"400"
    assert zap_reply([b"1.0"], allowed)[2] == b"400"


@pytest.mark.parametrize(
    ("producer_id", "user", "ok"),
    [
        ("hostA-3", "hostA", True),
        ("hostA", "hostA", True),
        ("hostB-3", "hostA", False),
        ("hostA-x", "hostA", False),
        ("hostAA-1", "hostA", False),
    ],
)
def test_a_key_speaks_only_for_its_own_name(producer_id: str, user: str, ok: bool) -> None:
    assert producer_id_matches(producer_id, user) is ok


def test_tcp_requires_keys_on_both_sides_with_one_line_naming_the_key(tmp_path: Path) -> None:
    plain = config_from_mapping({}).transport
    with pytest.raises(ConfigError, match="transport.curve_secret_key: is required for tcp://10.0.0.7:5555"):
        server_keys_for(plain, "tcp://10.0.0.7:5555")
    with pytest.raises(ConfigError, match="transport.curve_secret_key"):
        client_keys_for(plain, "tcp://10.0.0.7:5555")
    generate_keys(tmp_path, ["hostA"])
    half = config_from_mapping({"transport": {"curve_secret_key": str(tmp_path / "consumer.key_secret")}}).transport
    with pytest.raises(ConfigError, match="transport.curve_allowed_dir: is required with curve_secret_key"):
        server_keys_for(half, "tcp://10.0.0.7:5555")
    public_only = config_from_mapping(
        {
            "transport": {
                "curve_secret_key": str(tmp_path / "consumer.key"),
                "curve_allowed_dir": str(tmp_path / "producers"),
            }
        }
    ).transport
    with pytest.raises(ConfigError, match="holds no secret key"):
        server_keys_for(public_only, "tcp://10.0.0.7:5555")
    client = config_from_mapping(
        {
            "transport": {
                "curve_secret_key": str(tmp_path / "producers/hostA.key_secret"),
                "curve_server_key": str(tmp_path / "consumer.key"),
            }
        }
    ).transport
    keys = client_keys_for(client, "tcp://10.0.0.7:5555")
    assert keys is not None and keys.name == "hostA"


def test_keys_get_their_modes_explicitly_even_under_umask_000(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        generate_keys(tmp_path / "new" / "k", ["hostA"])
    finally:
        os.umask(old)
    k = tmp_path / "new" / "k"
    modes = {
        str(p.relative_to(tmp_path)): os.stat(p).st_mode & 0o777
        for p in (tmp_path / "new", k, k / "producers", *k.iterdir(), *(k / "producers").iterdir())
    }
    assert modes == {
        "new": 0o700,
        "new/k": 0o700,
        "new/k/producers": 0o700,
        "new/k/consumer.key": 0o644,
        "new/k/consumer.key_secret": 0o600,
        "new/k/producers/hostA.key": 0o644,
        "new/k/producers/hostA.key_secret": 0o600,
    }
    assert AllowList.load(k / "producers").names  # what it wrote, the consumer accepts
    os.chmod(k / "producers", 0o777)  # a keys directory others can write to
    generate_keys(k, ["hostB"])
    assert os.stat(k / "producers").st_mode & 0o777 == 0o700


def _refused(keys: Path) -> str:
    cfg = config_from_mapping(
        {
            "transport": {
                "curve_secret_key": str(keys / "consumer.key_secret"),
                "curve_allowed_dir": str(keys / "producers"),
            }
        }
    ).transport
    with pytest.raises(ConfigError) as info:
        server_keys_for(cfg, "tcp://10.0.0.7:5555")
    text = str(info.value)
    assert text.startswith("transport.curve_allowed_dir: ") and "\n" not in text
    return text


def test_the_consumer_refuses_an_allow_list_others_can_write_to(tmp_path: Path) -> None:
    generate_keys(tmp_path, ["hostA"])
    allowed = tmp_path / "producers"
    os.chmod(allowed, 0o770)
    assert f"{allowed} is mode 0770: its group can write to it" in _refused(tmp_path)
    os.chmod(allowed, 0o755)
    os.chmod(allowed / "hostA.key", 0o646)
    assert f"{allowed / 'hostA.key'} is mode 0646: every user can write to it" in _refused(tmp_path)
    os.chmod(allowed / "hostA.key", 0o444)
    assert (
        server_keys_for(
            config_from_mapping(
                {
                    "transport": {
                        "curve_secret_key": str(tmp_path / "consumer.key_secret"),
                        "curve_allowed_dir": str(allowed),
                    }
                }
            ).transport,
            "tcp://10.0.0.7:5555",
        )
        is not None
    )


def test_the_consumer_refuses_a_key_file_of_another_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    generate_keys(tmp_path, ["hostA", "hostB"])
    planted = tmp_path / "producers" / "hostB.key"
    if os.geteuid() == 0:
        os.chown(planted, 4242, -1)
    else:  # every file is this user's: pretend to be another one, so all but root's are foreign
        me = os.geteuid() + 1
        monkeypatch.setattr(os, "geteuid", lambda: me)
    text = _refused(tmp_path)
    assert str(tmp_path / "producers") in text and "belongs to uid" in text


# --- the allow-list's place, secret keys, and what `keys` writes (shared/filetrust.py) ----------------------


def _server_cfg(secret: Path, allowed: Path) -> object:
    return config_from_mapping(
        {"transport": {"curve_secret_key": str(secret), "curve_allowed_dir": str(allowed)}}
    ).transport


def _refusal(cfg: object, key: str) -> str:
    with pytest.raises(ConfigError) as info:
        server_keys_for(cfg, "tcp://10.0.0.7:5555") if key != "client" else client_keys_for(cfg, "tcp://10.0.0.7:5555")
    text = str(info.value)
    assert "\n" not in text
    return text


@needs_root
def test_an_allow_list_whose_parent_another_user_could_change_is_refused(tmp_path: Path) -> None:
    generate_keys(tmp_path / "keys", ["hostA"])
    secret, parent = tmp_path / "keys" / "consumer.key_secret", tmp_path / "team"
    parent.mkdir(mode=0o755)
    allowed = (tmp_path / "keys" / "producers").rename(parent / "producers")  # ours, 0700, in their directory:
    os.chown(parent, MALLORY, MALLORY)  # they could swap it whole
    assert _refusal(_server_cfg(secret, allowed), "server") == (
        f"transport.curve_allowed_dir: {allowed} is not safe: its parent {parent} belongs to uid {MALLORY}, who "
        "could move it; only this user or root may change the allow-list (chmod go-w, chown)"
    )
    os.chown(parent, 0, 0)
    os.chmod(parent, 0o777)  # anyone may rename producers/ and put theirs there
    assert f"its parent {parent} is mode 0777 without the sticky bit" in _refusal(
        _server_cfg(secret, allowed), "server"
    )
    os.chmod(parent, 0o1777)  # sticky: only its owner (we) may move it
    assert server_keys_for(_server_cfg(secret, allowed), "tcp://10.0.0.7:5555") is not None


@needs_root
def test_an_allow_list_reached_through_another_users_link_is_refused(tmp_path: Path) -> None:
    generate_keys(tmp_path / "keys", ["hostA"])
    link = plant_link(sticky_dir(tmp_path) / "allowed", tmp_path / "keys" / "producers")
    text = _refusal(_server_cfg(tmp_path / "keys" / "consumer.key_secret", link), "server")
    assert text.startswith(
        f"transport.curve_allowed_dir: {link} is not safe: it is reached through {link}, a "
        f"symbolic link of uid {MALLORY}, who could point it elsewhere"
    )


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        (0o640, "its group can read it"),
        (0o604, "other users can read it"),
        (0o644, "its group and other users can read it"),
        (0o620, "its group can write it"),
    ],
)
def test_a_secret_key_others_can_read_is_refused_on_both_sides(tmp_path: Path, mode: int, why: str) -> None:
    generate_keys(tmp_path, ["hostA"])
    secret = tmp_path / "consumer.key_secret"
    os.chmod(secret, mode)
    assert _refusal(_server_cfg(secret, tmp_path / "producers"), "server") == (
        f"transport.curve_secret_key: UNPROTECTED PRIVATE KEY FILE {secret}: is mode {mode:04o}: {why}; chmod 600 it"
    )
    client_secret = tmp_path / "producers" / "hostA.key_secret"
    os.chmod(client_secret, mode)
    client = config_from_mapping(
        {"transport": {"curve_secret_key": str(client_secret), "curve_server_key": str(tmp_path / "consumer.key")}}
    ).transport
    assert _refusal(client, "client").startswith(
        f"transport.curve_secret_key: UNPROTECTED PRIVATE KEY FILE {client_secret}: is mode {mode:04o}"
    )
    os.chmod(client_secret, 0o400)  # read-only for its owner: fine
    assert client_keys_for(client, "tcp://10.0.0.7:5555") is not None


@needs_root
def test_a_secret_key_of_another_user_or_through_their_link_is_refused(tmp_path: Path) -> None:
    generate_keys(tmp_path / "keys", ["hostA"])
    secret, allowed = tmp_path / "keys" / "consumer.key_secret", tmp_path / "keys" / "producers"
    os.chown(secret, MALLORY, MALLORY)  # they know (or chose) the key
    assert _refusal(_server_cfg(secret, allowed), "server") == (
        f"transport.curve_secret_key: UNPROTECTED PRIVATE KEY FILE {secret}: belongs to uid {MALLORY}, neither "
        "this user (0) nor root"
    )
    os.chown(secret, 0, 0)
    link = plant_link(sticky_dir(tmp_path) / "consumer.key_secret", secret)
    assert _refusal(_server_cfg(link, allowed), "server").startswith(
        f"transport.curve_secret_key: UNPROTECTED PRIVATE KEY FILE {link}: it is reached through {link}, a symbolic "
        f"link of uid {MALLORY}"
    )


@needs_root
def test_a_producer_refuses_a_server_key_another_user_could_change(tmp_path: Path) -> None:
    generate_keys(tmp_path / "keys", ["hostA"])
    server = tmp_path / "keys" / "consumer.key"
    os.chown(server, MALLORY, MALLORY)  # they could make us trust their consumer
    client = config_from_mapping(
        {
            "transport": {
                "curve_secret_key": str(tmp_path / "keys/producers/hostA.key_secret"),
                "curve_server_key": str(server),
            }
        }
    ).transport
    assert _refusal(client, "client").startswith(
        f"transport.curve_server_key: {server} belongs to uid {MALLORY}, neither this user (0) nor root; only this "
        "user or root may change a key this side trusts"
    )


def test_keys_creates_each_secret_0600_from_its_first_byte_under_umask_000(
    tmp_path: Path, umask_000: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[tuple[str, int, int]] = []
    real_open = os.open

    def recording_open(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        opened.append((os.fspath(path), flags, mode))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", recording_open)
    written = generate_keys(tmp_path / "k", ["hostA"])
    secrets = [p for p in written if p.name.endswith(".key_secret")]
    assert len(secrets) == 2
    for secret in secrets:
        [(_, flags, mode)] = [o for o in opened if o[0] == str(secret)]
        assert flags & os.O_CREAT and flags & os.O_EXCL and flags & os.O_NOFOLLOW and mode & 0o077 == 0
        assert os.stat(secret).st_mode & 0o777 == 0o600
    assert (
        server_keys_for(
            _server_cfg(tmp_path / "k" / "consumer.key_secret", tmp_path / "k" / "producers"), "tcp://10.0.0.7:5555"
        )
        is not None
    )  # what it wrote, the consumer accepts


@needs_root
def test_keys_refuses_a_directory_another_user_made_or_links_and_changes_nothing_there(tmp_path: Path) -> None:
    shared = sticky_dir(tmp_path)
    theirs = plant_dir(shared / "k", 0o777)  # pre-made in /tmp by another user
    proc = run_cli("keys", str(theirs), "--producer", "a")
    assert refusal(proc, "keys") == (
        f"{theirs}: refusing to write the keys: {theirs} belongs to uid {MALLORY}, not "
        "to this user (uid 0), who could replace what it holds"
    )
    assert list(theirs.iterdir()) == [] and os.stat(theirs).st_mode & 0o7777 == 0o777
    precious = tmp_path / "etc"  # their link to a directory of ours:
    precious.mkdir(mode=0o755)  # keys must neither chmod it nor write there
    link = plant_link(shared / "k2", precious)
    proc = run_cli("keys", str(link), "--producer", "a")
    assert refusal(proc, "keys").startswith(
        f"{link}: refusing to write the keys: it is reached through {link}, a symbolic link of uid {MALLORY}"
    )
    assert list(precious.iterdir()) == [] and os.stat(precious).st_mode & 0o777 == 0o755


def test_run_refuses_curve_keys_its_producers_could_not_use(tmp_path: Path) -> None:
    """``run`` gives its producers its own config: they would present the consumer's key and wait refused."""
    config = tmp_path / "run.yaml"
    config.write_text(
        f"transport:\n  endpoint: tcp://127.0.0.1:5611\n"
        f"  curve_secret_key: {tmp_path}/consumer.key_secret\n"
        f"  curve_allowed_dir: {tmp_path}/producers\n"
    )
    proc = run_cli("run", "--config", str(config), "--cache-dir", str(tmp_path))
    assert refusal(proc, "run").startswith(
        "transport.curve_secret_key: run starts its producers with this same "
        "config, so they would present the consumer's key and be refused"
    )
