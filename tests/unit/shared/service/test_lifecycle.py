"""shared/service/lifecycle.py: the runtime directory is refused when others can write to it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from melfeed.shared.errors import ConfigError
from melfeed.shared.service.lifecycle import prepare_runtime_dir


def test_a_new_runtime_directory_and_its_missing_parents_are_private_under_umask_000(
    tmp_path: Path, umask_000: None
) -> None:
    made = prepare_runtime_dir(tmp_path / "xdg" / "run" / "melfeed")  # an XDG_RUNTIME_DIR not made yet
    assert [p.stat().st_mode & 0o777 for p in (made.parent.parent, made.parent, made)] == [0o700] * 3


@pytest.mark.parametrize("mode", [0o700, 0o770, 0o750, 0o1770])
def test_our_own_or_our_groups_directory_is_kept(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "melfeed"
    path.mkdir()
    path.chmod(mode)
    assert prepare_runtime_dir(path) == path
    assert path.stat().st_mode & 0o7777 == mode  # never changed behind the operator's back


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o702])
def test_a_world_writable_runtime_directory_is_refused_with_one_line_naming_it_and_its_mode(
    tmp_path: Path, mode: int
) -> None:
    path = tmp_path / "melfeed"
    path.mkdir()
    path.chmod(mode)
    with pytest.raises(ConfigError) as info:
        prepare_runtime_dir(path)
    text = str(info.value)
    assert text.startswith(f"runtime_dir: runtime directory {path} is mode {mode & 0o7777:04o}: every user can write")
    assert "\n" not in text


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to a foreign group needs root")
def test_a_directory_writable_by_a_group_that_is_not_ours_is_refused(tmp_path: Path) -> None:
    foreign_gid = max(os.getgroups() + [os.getgid()]) + 4242
    path = tmp_path / "melfeed"
    path.mkdir()
    os.chown(path, -1, foreign_gid)
    path.chmod(0o750)  # the group may read: harmless
    assert prepare_runtime_dir(path) == path
    path.chmod(0o770)
    with pytest.raises(ConfigError, match=f"mode 0770: group {foreign_gid}, which is not ours, can write"):
        prepare_runtime_dir(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="a link owned by another user needs root to make")
def test_a_runtime_directory_linked_by_another_user_is_refused_even_when_it_points_at_ours(tmp_path: Path) -> None:
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    link = tmp_path / "melfeed-link"
    link.symlink_to(ours)
    assert prepare_runtime_dir(link) == link  # our own link: we alone can repoint it
    os.lchown(link, 65534, 65534)  # nobody's link: its owner could repoint it at will
    with pytest.raises(ConfigError, match="runtime directory is a symbolic link owned by uid 65534, not by this"):
        prepare_runtime_dir(link)


def test_raise_fd_limit_lifts_the_soft_limit_to_the_hard_one_and_warns_when_it_is_small(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import resource

    from melfeed.shared.service.lifecycle import raise_fd_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 64), hard))
        with caplog.at_level("WARNING", logger="melfeed.shared.service.lifecycle"):
            assert raise_fd_limit(max_connections=64) == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
        assert ("transport.max_connections" in caplog.text) == (hard != resource.RLIM_INFINITY and hard < 64 + 256)
        caplog.clear()
        with caplog.at_level("WARNING", logger="melfeed.shared.service.lifecycle"):
            raise_fd_limit(max_connections=hard)  # a bound the limit cannot hold
        assert hard == resource.RLIM_INFINITY or "transport.max_connections=" in caplog.text
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_child_whose_parent_is_already_gone_stops_itself_at_once() -> None:
    import signal
    import subprocess
    import sys

    code = (
        "import os; from melfeed.shared.service.lifecycle import die_with_parent; "
        "die_with_parent(parent_pid=os.getppid() + 1_000_000); print('still here')"
    )
    gone = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert gone.returncode == -signal.SIGTERM and "still here" not in gone.stdout
    code = (
        "import os; from melfeed.shared.service.lifecycle import die_with_parent; "
        "die_with_parent(parent_pid=os.getppid())"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_only_a_parent_named_in_the_environment_is_followed() -> None:
    import signal
    import subprocess
    import sys

    from melfeed.shared.service.lifecycle import PARENT_PID_ENV, die_with_named_parent

    assert die_with_named_parent(environ={}) is False  # by hand, under systemd: follows nobody
    assert die_with_named_parent(environ={PARENT_PID_ENV: "x"}) is False
    code = (
        "from melfeed.shared.service.lifecycle import die_with_named_parent; print(die_with_named_parent(), flush=True)"
    )
    named = {**os.environ, PARENT_PID_ENV: str(os.getpid())}  # this test's process: the real parent
    done = subprocess.run([sys.executable, "-c", code], env=named, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "True"
    stale = {**os.environ, PARENT_PID_ENV: str(os.getppid())}  # a grandparent's pid: not its parent
    gone = subprocess.run([sys.executable, "-c", code], env=stale, capture_output=True, text=True, timeout=60)
    assert gone.returncode == -signal.SIGTERM and gone.stdout == ""
