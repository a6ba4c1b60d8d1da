"""CURVE keys, the producer allow-list and the ZAP decisions for tcp endpoints (loopback included).

``melfeed keys DIR --producer NAME ...`` writes, with pyzmq's certificate format
(``zmq.auth.create_certificates``: ``NAME.key`` public, mode 0644; ``NAME.key_secret`` secret, mode
0600; ``DIR`` and ``DIR/producers`` 0700; each set explicitly, whatever the umask)::

    DIR/consumer.key, DIR/consumer.key_secret          the consumer's pair
    DIR/producers/NAME.key, DIR/producers/NAME.key_secret   one pair per producer host/name

Copy ``consumer.key`` and ``producers/NAME.key_secret`` to producer host NAME; the consumer keeps
``consumer.key_secret`` and the public ``producers/*.key`` (its allow-list). ``keys`` refuses a ``DIR``
another user could change (``check_private_dir``) and creates each secret key 0600 before writing it.
Trust, all exit 78 naming the key (``shared/filetrust.py``, ``shared/output_files.py``,
docs/security.md "Files"):
- The allow-list is read once, at start; the consumer refuses it when the directory or a key file in
  it is not its own user's or root's, or its group or others can write to it, or another user could
  swap it (a parent directory or a symbolic link on the way: ``place_reason``): whoever can add a file
  there is admitted. A producer's ``transport.curve_server_key`` (whom it trusts) likewise.
- A secret key (``transport.curve_secret_key``, both sides) is refused when its group or others have
  any permission on it, it belongs to neither this user nor root, or another user could swap it
  (OpenSSH's "UNPROTECTED PRIVATE KEY FILE").
ZAP: the consumer answers ZAP requests itself (``zap_reply``, polled by the receiver thread). A
CURVE client whose key is in the allow-list is admitted with User-Id = its NAME; any other key is
refused (400), so no frame of it reaches the application; plaintext clients fail the CURVE
handshake before ZAP. The receiver then requires HELLO's producer id to be NAME or ``NAME-<n>``.
"""

from __future__ import annotations

import argparse
import datetime
import errno
import logging
import os
import re
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85

from melfeed.shared.errors import ConfigError
from melfeed.shared.filetrust import (
    check_private_dir,
    creation_reason,
    make_dirs,
    place_reason,
    private_file_reason,
    untrusted_reason,
)
from melfeed.shared.output_files import create_new, replace_output

__all__ = [
    "AllowList",
    "ServerKeys",
    "ClientKeys",
    "ZAP_ENDPOINT",
    "client_keys_for",
    "generate_keys",
    "main_keys",
    "producer_id_matches",
    "server_keys_for",
    "zap_reply",
]

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_VERSION = b"1.0"


def _load(path: Path, what: tuple[str, ...], secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read CURVE key file {path}: {err}", path=what) from err
    if secret and not secret_key:
        raise ConfigError(f"{path} holds no secret key (pass the .key_secret file)", path=what)
    if secret:
        _private(path, what)  # after reading: a public key passed by mistake is named as such
    return public, secret_key


def _private(path: Path, what: tuple[str, ...]) -> None:
    """Refuse a secret key file that others could read, or swap for a key of their own."""
    try:
        reason = private_file_reason(path)
    except OSError as err:
        raise ConfigError(f"cannot read CURVE key file {path}: {err.strerror or err}", path=what) from err
    if reason is not None:
        raise ConfigError(f"UNPROTECTED PRIVATE KEY FILE {path}: {reason}", path=what)


def _trusted(path: Path, *, directory: bool, what: tuple[str, ...] = ("transport", "curve_allowed_dir")) -> None:
    """Refuse an allow-list entry (the directory or a key file), or a trusted server key, that someone
    else could change or swap."""
    try:
        reason = untrusted_reason(path, directory=directory)
        if reason is None:
            place = place_reason(path)
            reason = None if place is None else f"is not safe: {place}"
    except OSError as err:
        raise ConfigError(f"cannot examine {path}: {err.strerror}", path=what) from err
    if reason is not None:
        whose = "the allow-list" if what[-1] == "curve_allowed_dir" else "a key this side trusts"
        raise ConfigError(f"{path} {reason}; only this user or root may change {whose} (chmod go-w, chown)", path=what)


@dataclass(frozen=True, slots=True)
class AllowList:
    """Public key (z85) -> producer name, from ``DIR/*.key``."""

    names: dict[bytes, str]

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> AllowList:
        """Read the allow-list once (the consumer never reloads it: a change takes a restart).

        Raises:
            ConfigError: naming ``transport.curve_allowed_dir``: not a directory, no key in it, a key
                file that cannot be read, or the directory or a key file is not this user's or root's
                or is writable by its group or others (whoever can write there can admit any key).
        """
        root = Path(directory)
        if not root.is_dir():
            raise ConfigError(f"is not a directory: {root}", path=("transport", "curve_allowed_dir"))
        _trusted(root, directory=True)
        names = {}
        for path in sorted(root.glob("*.key")):
            _trusted(path, directory=False)
            public, _ = _load(path, ("transport", "curve_allowed_dir"), secret=False)
            names[public] = path.stem
        if not names:
            raise ConfigError(f"holds no producer public keys (*.key): {root}", path=("transport", "curve_allowed_dir"))
        return cls(names)


@dataclass(frozen=True, slots=True)
class ServerKeys:
    public: bytes
    secret: bytes
    allowed: AllowList

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        sock.curve_server = True
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.zap_domain = b"melfeed"


@dataclass(frozen=True, slots=True)
class ClientKeys:
    name: str  # the producer name its key was issued for
    public: bytes
    secret: bytes
    server_public: bytes

    @classmethod
    def load(cls, secret_file: str, server_key_file: str) -> ClientKeys:
        """This producer's pair and the consumer's public key.

        Raises:
            ConfigError: naming the key: a file that cannot be read, a secret key others could read or
                swap (``_private``), a server key others could change or swap (``_trusted``).
        """
        public, secret = _load(Path(secret_file), ("transport", "curve_secret_key"), secret=True)
        _trusted(Path(server_key_file), directory=False, what=("transport", "curve_server_key"))
        server, _ = _load(Path(server_key_file), ("transport", "curve_server_key"), secret=False)
        assert secret is not None
        return cls(Path(secret_file).name.removesuffix(".key_secret"), public, secret, server)

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret
        sock.curve_serverkey = self.server_public


def load_server_keys(secret_file: str, allowed_dir: str) -> ServerKeys:
    public, secret = _load(Path(secret_file), ("transport", "curve_secret_key"), secret=True)
    assert secret is not None
    return ServerKeys(public, secret, AllowList.load(allowed_dir))


def zap_reply(request: Sequence[bytes], allowed: AllowList) -> list[bytes]:
    """The ZAP (RFC 27) reply to one request: 200 + User-Id NAME for an allowed CURVE key, else 400."""
    if len(request) < 6:
        return [_ZAP_VERSION, request[1] if len(request) > 1 else b"", b"400", b"malformed ZAP request", b"", b""]
    version, request_id, _domain, _address, _identity, mechanism = request[:6]
    credentials = request[6:]

    def deny(reason: bytes) -> list[bytes]:
        return [_ZAP_VERSION, request_id, b"400", reason, b"", b""]

    if version != _ZAP_VERSION:
        return deny(b"unsupported ZAP version")
    if mechanism != b"CURVE" or len(credentials) != 1:
        return deny(b"CURVE required")
    name = allowed.names.get(zmq.utils.z85.encode(credentials[0]))
    if name is None:
        return deny(b"unknown key")
    return [_ZAP_VERSION, request_id, b"200", b"OK", name.encode(), b""]


def producer_id_matches(producer_id: str, user_id: str) -> bool:
    """A key named NAME may announce producer id NAME or NAME-<number>."""
    if producer_id == user_id:
        return True
    head, _, tail = producer_id.rpartition("-")
    return head == user_id and tail.isdigit()


_KEY_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")  # a producer name becomes file names and a User-Id


def generate_keys(directory: str | os.PathLike[str], producers: Sequence[str]) -> list[Path]:
    """Write the consumer's pair (if absent) and one pair per producer name; returns the files.

    Raises:
        ConfigError: a name that is not 1..64 of ``[A-Za-z0-9._-]`` starting with a letter, digit or ``_``
            (``--producer``; checked before anything is written), or ``directory`` cannot be created or
            written (a file in the way, read-only, ``/proc``): one line with the OS reason.
    """
    for name in producers:
        if not _KEY_NAME.fullmatch(name):
            raise ConfigError(
                "must be 1..64 letters, digits, '.', '_' or '-', not starting with '.' or '-'",
                path=("--producer",),
                got=name,
            )
    root = Path(directory)
    written: list[Path] = []
    try:
        reason = creation_reason(root)  # before anything is made: not even an empty directory
        if reason is not None:
            raise ConfigError(f"{root}: refusing to write the keys: {reason}")
        make_dirs(root, 0o700)  # parents too: not the umask's default (0777 under umask 000)
        _own_directory(root)  # before anything is changed or written in it
        os.chmod(root, 0o700)
        allowed = root / "producers"
        make_dirs(allowed, 0o700)
        if _is_own_directory(allowed):
            os.chmod(allowed, 0o700)  # the consumer refuses an allow-list others can write to
        _own_directory(allowed)
        for where, name in [(root, "consumer")] + [(allowed, n) for n in producers]:
            secret, public = where / f"{name}.key_secret", where / f"{name}.key"
            if os.path.lexists(secret):
                continue  # never overwrite a key in use
            public_z85, secret_z85 = zmq.curve_keypair()
            # 0600 from its creation on: never readable by others, whatever the umask (pyzmq's
            # create_certificates leaves the mode to the umask until a chmod afterwards)
            create_new(secret, _certificate(public_z85, secret_z85), 0o600)
            replace_output(public, _certificate(public_z85, None), 0o644)
            written += [public, secret]
    except OSError as err:
        if isinstance(err, PermissionError) and err.filename is None:  # check_private_dir: another user's
            raise ConfigError(f"{root}: refusing to write the keys: {err.strerror}") from err
        at = f" at {err.filename}" if err.filename and os.fspath(err.filename) != os.fspath(root) else ""
        raise ConfigError(f"{root}: cannot write the keys{at} ({err.strerror})") from err
    return written


def _is_own_directory(path: Path) -> bool:
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def _own_directory(path: Path) -> None:
    """``check_private_dir``, with the directory named when it is not one (a file in the way)."""
    if not path.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
    check_private_dir(path)


def _certificate(public: bytes, secret: bytes | None) -> bytes:
    """pyzmq's (czmq's ZPL) certificate text, which ``zmq.auth.load_certificate`` reads."""
    kind = "Secret" if secret else "Public"
    lines = [
        f"#   ****  Generated on {datetime.datetime.now():%Y-%m-%d %H:%M:%S} by melfeed keys  ****",
        f"#   ZeroMQ CURVE **{kind}** Certificate",
        "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions."
        if secret
        else "#   Exchange securely, or use a secure mechanism to verify the contents of this file after exchange.",
        "",
        "metadata",
        "curve",
        f'    public-key = "{public.decode("ascii")}"',
    ]
    if secret:
        lines.append(f'    secret-key = "{secret.decode("ascii")}"')
    return ("\n".join(lines) + "\n").encode("ascii")


def _need(value: str | None, key: str, why: str) -> str:
    if not value:
        raise ConfigError(f"is required {why}", path=("transport", key))
    return value


def _own_secret(transport: object, endpoint: str) -> str | None:
    """This side's secret key file, or ``None`` when plaintext is allowed (ipc, or tcp marked insecure).

    Loopback tcp is no exception: every local user can connect to it (docs/security.md "Who can connect").
    """
    secret = getattr(transport, "curve_secret_key", None)
    if not secret and endpoint.startswith("tcp://") and not getattr(transport, "insecure", False):
        _need(
            None,
            "curve_secret_key",
            f"for {endpoint}: tcp needs CURVE, loopback included (melfeed keys), or transport.insecure: true",
        )
    return secret or None


def server_keys_for(transport: object, endpoint: str) -> ServerKeys | None:
    """The consumer's CURVE setup from ``TransportConfig``; ``None`` for ipc/loopback without keys.

    Raises:
        ConfigError: a non-loopback tcp endpoint without keys, or a half-configured key set.
    """
    secret = _own_secret(transport, endpoint)
    if secret is None:
        if endpoint.startswith(("tcp://", "ipc://@")):  # an abstract socket: every local user reaches it
            log.warning(
                "transport.insecure: true: %s takes unauthenticated peers; any user who can reach it "
                "may join as a producer",
                endpoint,
            )
        return None
    return load_server_keys(
        secret, _need(getattr(transport, "curve_allowed_dir", None), "curve_allowed_dir", "with curve_secret_key")
    )


def client_keys_for(transport: object, endpoint: str) -> ClientKeys | None:
    """A producer's CURVE setup from ``TransportConfig``; ``None`` for ipc/loopback without keys."""
    secret = _own_secret(transport, endpoint)
    if secret is None:
        return None
    return ClientKeys.load(
        secret, _need(getattr(transport, "curve_server_key", None), "curve_server_key", "with curve_secret_key")
    )


def main_keys(args: argparse.Namespace) -> int:
    """``melfeed keys DIR --producer NAME ...``: print what was written and where it goes."""
    root = Path(args.dir)
    names = list(args.producer or [])
    written = generate_keys(root, names)
    for path in written:
        print(f"wrote {path}")
    print(
        f"consumer: transport.curve_secret_key={root / 'consumer.key_secret'} "
        f"transport.curve_allowed_dir={root / 'producers'}"
    )
    for name in names:
        print(
            f"producer {name}: copy {root / 'consumer.key'} and {root / 'producers' / (name + '.key_secret')}; "
            f"transport.curve_server_key=consumer.key transport.curve_secret_key={name}.key_secret"
        )
    return 0
