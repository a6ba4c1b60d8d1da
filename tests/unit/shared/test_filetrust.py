"""melfeed.shared.filetrust and melfeed.shared.output_files: modes that do not depend on the umask, who may change a
file
melfeed trusts, and writes another user cannot redirect."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from melfeed.shared.errors import ConfigError
from melfeed.shared.filetrust import check_private_dir, make_dirs, place_reason, untrusted_reason
from melfeed.shared.output_files import (
    check_output,
    create_new,
    open_output,
    output_dir_reason,
    replace_output,
    write_output,
)
from tests.planted import MALLORY, needs_root, plant_dir, plant_file, plant_link, sticky_dir, victim


def _mode(path: Path) -> int:
    return os.lstat(path).st_mode & 0o777


def test_new_outputs_are_0640_under_umask_000_and_old_ones_keep_their_mode(tmp_path: Path, umask_000: None) -> None:
    new = tmp_path / "new.json"
    write_output(new, "one\n")
    write_output(new, "two\n")  # replaced, not appended
    assert (_mode(new), new.read_text()) == (0o640, "two\n")
    mine = tmp_path / "mine.jsonl"
    mine.write_text("a\n")
    os.chmod(mine, 0o604)  # the operator's choice
    os.close(open_output(mine, append=True))
    with os.fdopen(open_output(mine, append=True), "a") as out:
        out.write("b\n")
    assert (_mode(mine), mine.read_text()) == (0o604, "a\nb\n")


def test_a_stricter_umask_still_narrows_a_new_output(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        write_output(tmp_path / "x", "x")
    finally:
        os.umask(old)
    assert _mode(tmp_path / "x") == 0o600


def test_missing_parents_get_the_mode_asked_for_under_umask_000(tmp_path: Path, umask_000: None) -> None:
    make_dirs(tmp_path / "a" / "b" / "c", 0o700)
    make_dirs(tmp_path / "a" / "b" / "c", 0o700)  # existing: fine
    assert [_mode(tmp_path / p) for p in ("a", "a/b", "a/b/c")] == [0o700] * 3
    (tmp_path / "f").write_text("")
    with pytest.raises(OSError):
        make_dirs(tmp_path / "f" / "d", 0o700)


def test_only_what_this_user_or_root_alone_can_write_is_trusted(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    f = d / "a.key"
    f.write_text("k")
    os.chmod(f, 0o644)
    assert untrusted_reason(d, directory=True) is None and untrusted_reason(f, directory=False) is None
    os.chmod(f, 0o664)
    assert untrusted_reason(f, directory=False) == "is mode 0664: its group can write to it"
    os.chmod(d, 0o777)
    assert untrusted_reason(d, directory=True) == "is mode 0777: its group and every user can write to it"
    assert untrusted_reason(f, directory=True) == "is not a directory"
    assert untrusted_reason(d, directory=False) == "is not a regular file"
    link = tmp_path / "link"
    link.symlink_to(d)
    assert untrusted_reason(link, directory=True, follow=False) == "is a symbolic link"
    assert untrusted_reason(link, directory=True) == untrusted_reason(d, directory=True)  # followed: the target
    with pytest.raises(FileNotFoundError):
        untrusted_reason(tmp_path / "missing", directory=True)


def test_a_file_of_another_user_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "a.key"
    f.write_text("k")
    os.chmod(f, 0o644)
    if os.geteuid() == 0:
        os.chown(f, 4242, -1)  # root can give it away
        owner, me = 4242, 0
    else:  # else this process pretends to be someone else
        owner, me = os.geteuid(), os.geteuid() + 1
        monkeypatch.setattr(os, "geteuid", lambda: me)
    assert untrusted_reason(f, directory=False) == f"belongs to uid {owner}, neither this user ({me}) nor root"


# --- who could swap it: place_reason, the one parent rule (check_private_dir, allow-list, keys, outputs) ---


@needs_root
def test_a_place_is_trusted_only_through_this_users_or_roots_directories_and_links(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    assert place_reason(mine / "x") is None and place_reason(mine) is None  # missing last part: fine
    shared = sticky_dir(tmp_path)  # /tmp: others write, but sticky
    (shared / "d").mkdir()
    assert place_reason(shared / "d" / "x") is None
    os.chmod(shared, 0o777)  # not sticky: anyone may rename d
    assert (
        place_reason(shared / "d" / "x") == f"its parent {shared} is mode 0777 without the sticky bit: other "
        "users could move it"
    )
    os.chmod(shared, 0o1777)
    theirs = plant_dir(shared / "theirs", 0o755)  # another user's directory, even 0755
    assert place_reason(theirs / "x") == f"its parent {theirs} belongs to uid {MALLORY}, who could move it"
    link = plant_link(shared / "link", mine)  # their link to our own directory
    assert place_reason(link / "x") == (
        f"it is reached through {link}, a symbolic link of uid {MALLORY}, who could point it elsewhere"
    )
    assert place_reason(link) is not None  # the last component's link counts too
    own_link = shared / "own"
    own_link.symlink_to(theirs)  # our link, but to their directory
    assert place_reason(own_link / "x") == f"its parent {theirs} belongs to uid {MALLORY}, who could move it"
    relative = mine / "rel"
    relative.symlink_to("../mine/.")  # links are followed as the kernel does
    assert place_reason(relative / "x") is None
    with pytest.raises(FileNotFoundError):
        place_reason(tmp_path / "missing" / "x")


@needs_root
def test_check_private_dir_uses_the_same_rule_for_links_on_the_way(tmp_path: Path) -> None:
    mine = tmp_path / "state"
    mine.mkdir(mode=0o700)
    check_private_dir(mine)
    link = plant_link(sticky_dir(tmp_path) / "state", mine)
    with pytest.raises(PermissionError, match=f"reached through {link}, a symbolic link of uid {MALLORY}"):
        check_private_dir(link)


# --- outputs: never through a link, never into another user's planted file --------------------------------


@needs_root
def test_an_output_never_follows_a_link_planted_in_a_sticky_directory(tmp_path: Path) -> None:
    bashrc = victim(tmp_path)
    shared = sticky_dir(tmp_path)
    link = plant_link(shared / "m.jsonl", bashrc)
    for append in (True, False):
        with pytest.raises(
            ConfigError,
            match=f"^consumer.metrics_file: refusing to write {link}: is a symbolic link, which is never followed",
        ):
            open_output(link, append=append, what="consumer.metrics_file")
    with pytest.raises(ConfigError, match="is a symbolic link"):
        write_output(link, "x")
    assert bashrc.read_text() == "alias ls='ls --color'\n"
    own = tmp_path / "home" / "latest.json"  # our own link is not followed either
    own.symlink_to(bashrc)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        write_output(own, "x")
    assert bashrc.read_text() == "alias ls='ls --color'\n"


@needs_root
def test_an_output_refuses_another_users_file_or_a_hard_link_where_others_can_create_files(tmp_path: Path) -> None:
    shared = sticky_dir(tmp_path)
    planted = plant_file(shared / "summary.json")
    with pytest.raises(
        ConfigError,
        match=f"^--json: refusing to write {planted}: belongs to uid {MALLORY}, not to "
        f"this user \\(uid 0\\), in {shared}, where other users can create files$",
    ):
        write_output(planted, "{}", what="--json")
    assert planted.read_text() == "mallory was here\n"
    bashrc = victim(tmp_path)
    hard = shared / "m.jsonl"
    os.link(bashrc, hard)  # our own file, under a name in /tmp
    with pytest.raises(ConfigError, match="has 2 hard links"):
        open_output(hard, append=True)
    assert bashrc.read_text() == "alias ls='ls --color'\n"
    mine = shared / "mine.jsonl"  # our own file in /tmp: fine
    write_output(mine, "a\n")
    with os.fdopen(open_output(mine, append=True), "a") as out:
        out.write("b\n")
    assert mine.read_text() == "a\nb\n"
    theirs_private = tmp_path / "home" / "given.json"  # where no other user can create files, a file
    plant_file(theirs_private)  # root handed over stays writable
    write_output(theirs_private, "ok\n")
    assert theirs_private.read_text() == "ok\n"


@needs_root
def test_an_output_in_a_directory_another_user_controls_is_refused(tmp_path: Path) -> None:
    theirs = plant_dir(sticky_dir(tmp_path) / "out", 0o755)
    with pytest.raises(ConfigError, match=f"its parent {theirs} belongs to uid {MALLORY}, who could move it"):
        write_output(theirs / "report.png", b"png")
    assert not (theirs / "report.png").exists()


@needs_root
def test_the_descriptor_is_checked_again_so_a_trap_set_after_the_check_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A link or file planted between ``check_output`` and the open: ``O_NOFOLLOW`` and ``fstat`` catch it."""
    import melfeed.shared.output_files as output_files

    monkeypatch.setattr(output_files, "check_output", lambda path, what=None: None)  # as if planted just after it
    bashrc = victim(tmp_path)
    shared = sticky_dir(tmp_path)
    with pytest.raises(ConfigError, match="is a symbolic link"):
        open_output(plant_link(shared / "m.jsonl", bashrc), append=True)
    planted = plant_file(shared / "s.json")
    with pytest.raises(ConfigError, match=f"belongs to uid {MALLORY}"):
        write_output(planted, "{}")  # refused before the truncation
    assert bashrc.read_text() == "alias ls='ls --color'\n" and planted.read_text() == "mallory was here\n"


def test_a_fifo_or_a_directory_in_an_outputs_place_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "m.jsonl"
    os.mkfifo(fifo)  # nobody reads it: open(2) would block
    with pytest.raises(ConfigError, match="is not a regular file"):
        open_output(fifo, append=True)
    with pytest.raises(ConfigError, match="is a directory"):
        check_output(tmp_path)


def test_check_output_says_the_same_before_the_work(tmp_path: Path) -> None:
    check_output(tmp_path / "new.json")  # nothing there yet: no error
    (tmp_path / "link").symlink_to(tmp_path / "new.json")
    with pytest.raises(ConfigError, match="^--summary-json: refusing to write .*: is a symbolic link"):
        check_output(tmp_path / "link", "--summary-json")


def test_create_new_and_replace_output_set_the_exact_mode_from_the_first_byte(
    tmp_path: Path, umask_000: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    created: list[tuple[str, int, int]] = []
    real_open = os.open

    def recording_open(path: Any, flags: int, mode: int = 0o777, **kw: Any) -> int:
        created.append((os.fspath(path), flags, mode))
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(os, "open", recording_open)
    secret = tmp_path / "a.key_secret"
    create_new(secret, b"s", 0o600)
    [(_, flags, mode)] = [c for c in created if c[0] == str(secret)]
    assert flags & os.O_EXCL and flags & os.O_NOFOLLOW and mode & 0o077 == 0  # never wider, not for a moment
    assert _mode(secret) == 0o600
    with pytest.raises(FileExistsError):
        create_new(secret, b"other", 0o600)  # never overwritten
    assert secret.read_bytes() == b"s"
    public = tmp_path / "a.key"
    bashrc = victim(tmp_path)
    public.symlink_to(bashrc)
    replace_output(public, b"p", 0o644)  # the rename replaces the link itself
    assert (_mode(public), public.read_bytes(), bashrc.read_text()) == (0o644, b"p", "alias ls='ls --color'\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.key", "a.key_secret", "home"]  # no temp file left


@needs_root
def test_a_directory_melfeed_fills_must_be_writable_by_nobody_else(tmp_path: Path) -> None:
    mine = tmp_path / "cache"
    mine.mkdir(mode=0o755)
    assert output_dir_reason(mine) is None
    shared = sticky_dir(tmp_path)
    assert output_dir_reason(shared) == "is mode 1777: other users can write to it"  # sticky is not enough
    theirs = plant_dir(shared / "cache", 0o755)
    assert output_dir_reason(theirs) == f"belongs to uid {MALLORY}, neither this user (0) nor root"


_WRITE_SIGNALLED = """
import os, signal, sys
import melfeed.shared.output_files as of
truncating_open = of.open_output
def open_then_signalled(*args, **kwargs):
    fd = truncating_open(*args, **kwargs)            # the file is empty from here
    os.kill(os.getpid(), signal.SIGTERM)
    return fd
of.open_output = open_then_signalled
of.write_output(sys.argv[1], "new report\\n" * 1000)
print("not reached: the held SIGTERM ends the process once the file is whole")
"""


def test_a_sigterm_during_a_report_write_ends_the_process_after_the_whole_file_is_written(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    out.write_text("old report\n")
    done = subprocess.run(
        [sys.executable, "-c", _WRITE_SIGNALLED, str(out)],
        cwd=Path(__file__).parents[3],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == -signal.SIGTERM, done.stdout + done.stderr  # the default action, still
    assert out.read_text() == "new report\n" * 1000
