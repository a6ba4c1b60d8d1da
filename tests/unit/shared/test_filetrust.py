"""shared.filetrust: modes that do not depend on the umask, and who may change a file melfeed trusts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.filetrust import make_dirs, open_output, untrusted_reason, write_output


def _mode(path: Path) -> int:
    return os.lstat(path).st_mode & 0o777


def test_new_outputs_are_0640_under_umask_000_and_old_ones_keep_their_mode(tmp_path: Path, umask_000: None) -> None:
    new = tmp_path / "new.json"
    write_output(new, "one\n")
    write_output(new, "two\n")                     # replaced, not appended
    assert (_mode(new), new.read_text()) == (0o640, "two\n")
    mine = tmp_path / "mine.jsonl"
    mine.write_text("a\n")
    os.chmod(mine, 0o604)                          # the operator's choice
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
    make_dirs(tmp_path / "a" / "b" / "c", 0o700)    # existing: fine
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
    assert untrusted_reason(link, directory=True) == untrusted_reason(d, directory=True)   # followed: the target
    with pytest.raises(FileNotFoundError):
        untrusted_reason(tmp_path / "missing", directory=True)


def test_a_file_of_another_user_is_not_trusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "a.key"
    f.write_text("k")
    os.chmod(f, 0o644)
    if os.geteuid() == 0:
        os.chown(f, 4242, -1)              # root can give it away
        owner, me = 4242, 0
    else:                                  # else this process pretends to be someone else
        owner, me = os.geteuid(), os.geteuid() + 1
        monkeypatch.setattr(os, "geteuid", lambda: me)
    assert untrusted_reason(f, directory=False) == f"belongs to uid {owner}, neither this user ({me}) nor root"
