"""CURVE keys, allow-list, ZAP decisions and when CURVE is required (pure logic + key files)."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest
import zmq.utils.z85

from shared.config_loader import config_from_mapping
from shared.wire.curve import (AllowList, client_keys_for, generate_keys, producer_id_matches, server_keys_for,
                               zap_reply)
from shared.errors import ConfigError
from tests.cli_run import refusal, run_cli


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5555", "tcp://localhost:5555", "tcp://[::1]:5555",
                                      "tcp://10.0.0.7:5555", "tcp://0.0.0.0:5555"])
def test_every_tcp_endpoint_loopback_included_needs_curve_unless_marked_insecure(
        endpoint: str, caplog: pytest.LogCaptureFixture) -> None:
    plain = config_from_mapping({}).transport
    with pytest.raises(ConfigError, match=f"transport.curve_secret_key: is required for {re.escape(endpoint)}: "
                                          "tcp needs CURVE, loopback included"):
        server_keys_for(plain, endpoint)
    with pytest.raises(ConfigError, match="transport.insecure: true"):
        client_keys_for(plain, endpoint)
    insecure = config_from_mapping({"transport": {"insecure": True}}).transport
    with caplog.at_level(logging.WARNING, logger="shared.wire.curve"):
        assert server_keys_for(insecure, endpoint) is None and client_keys_for(insecure, endpoint) is None
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]     # the consumer's, once
    assert "transport.insecure" in warning.getMessage() and endpoint in warning.getMessage()


def test_ipc_needs_no_curve_and_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    plain = config_from_mapping({}).transport
    with caplog.at_level(logging.WARNING):
        assert server_keys_for(plain, "ipc:///run/melfeed/melfeed.sock") is None
    assert caplog.records == []


def test_keys_are_written_once_with_private_secrets_and_load_as_an_allow_list(tmp_path: Path) -> None:
    written = generate_keys(tmp_path / "k", ["hostA", "hostB"])
    assert {p.name for p in written} == {"consumer.key", "consumer.key_secret", "hostA.key", "hostA.key_secret",
                                         "hostB.key", "hostB.key_secret"}
    assert oct(os.stat(tmp_path / "k" / "producers" / "hostA.key_secret").st_mode & 0o777) == "0o600"
    assert generate_keys(tmp_path / "k", ["hostA"]) == []            # never overwrites a key in use
    allowed = AllowList.load(tmp_path / "k" / "producers")
    assert sorted(allowed.names.values()) == ["hostA", "hostB"]


@pytest.mark.parametrize("name", ["a\nb", "", ".hidden", "-flag", "a/b", "..", "a b", "x" * 65, "caf\u00e9", "a\x00"])
def test_a_producer_name_that_is_not_a_safe_token_is_refused_before_anything_is_written(tmp_path: Path,
                                                                                        name: str) -> None:
    with pytest.raises(ConfigError, match="^--producer: must be 1..64 letters, digits") as info:
        generate_keys(tmp_path / "k", ["good", name])
    assert "\n" not in str(info.value)
    assert not (tmp_path / "k").exists()          # no key named with a newline, no half-written directory


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
    assert zap_reply([b"1.0", b"8", b"melfeed", b"", b"", b"CURVE", bytes(32)], allowed)[2:4] == [b"400", b"unknown key"]
    assert zap_reply([b"1.0", b"9", b"melfeed", b"", b"", b"NULL"], allowed)[2:4] == [b"400", b"CURVE required"]
    assert zap_reply([b"2.0", b"9", b"", b"", b"", b"CURVE", raw], allowed)[2] == b"400"
    assert zap_reply([b"1.0"], allowed)[2] == b"400"


@pytest.mark.parametrize(("producer_id", "user", "ok"), [
    ("hostA-3", "hostA", True), ("hostA", "hostA", True), ("hostB-3", "hostA", False),
    ("hostA-x", "hostA", False), ("hostAA-1", "hostA", False)])
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
    public_only = config_from_mapping({"transport": {"curve_secret_key": str(tmp_path / "consumer.key"),
                                                     "curve_allowed_dir": str(tmp_path / "producers")}}).transport
    with pytest.raises(ConfigError, match="holds no secret key"):
        server_keys_for(public_only, "tcp://10.0.0.7:5555")
    client = config_from_mapping({"transport": {"curve_secret_key": str(tmp_path / "producers/hostA.key_secret"),
                                                "curve_server_key": str(tmp_path / "consumer.key")}}).transport
    keys = client_keys_for(client, "tcp://10.0.0.7:5555")
    assert keys is not None and keys.name == "hostA"


def test_keys_get_their_modes_explicitly_even_under_umask_000(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        generate_keys(tmp_path / "new" / "k", ["hostA"])
    finally:
        os.umask(old)
    k = tmp_path / "new" / "k"
    modes = {str(p.relative_to(tmp_path)): os.stat(p).st_mode & 0o777
             for p in (tmp_path / "new", k, k / "producers", *k.iterdir(), *(k / "producers").iterdir())}
    assert modes == {"new": 0o700, "new/k": 0o700, "new/k/producers": 0o700,
                     "new/k/consumer.key": 0o644, "new/k/consumer.key_secret": 0o600,
                     "new/k/producers/hostA.key": 0o644, "new/k/producers/hostA.key_secret": 0o600}
    assert AllowList.load(k / "producers").names                      # what it wrote, the consumer accepts
    os.chmod(k / "producers", 0o777)                                  # left so by an older version
    generate_keys(k, ["hostB"])
    assert os.stat(k / "producers").st_mode & 0o777 == 0o700


def _refused(keys: Path) -> str:
    cfg = config_from_mapping({"transport": {"curve_secret_key": str(keys / "consumer.key_secret"),
                                             "curve_allowed_dir": str(keys / "producers")}}).transport
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
    assert server_keys_for(config_from_mapping({"transport": {
        "curve_secret_key": str(tmp_path / "consumer.key_secret"),
        "curve_allowed_dir": str(allowed)}}).transport, "tcp://10.0.0.7:5555") is not None


def test_the_consumer_refuses_a_key_file_of_another_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    generate_keys(tmp_path, ["hostA", "hostB"])
    planted = tmp_path / "producers" / "hostB.key"
    if os.geteuid() == 0:
        os.chown(planted, 4242, -1)
    else:       # every file is this user's: pretend to be another one, so all but root's are foreign
        me = os.geteuid() + 1
        monkeypatch.setattr(os, "geteuid", lambda: me)
    text = _refused(tmp_path)
    assert str(tmp_path / "producers") in text and "belongs to uid" in text
