"""consumer/app.py ``run_exit_code``: ``run`` exits with a code docs/reference/exit-codes.md lists, whatever ended its
producer group."""

from __future__ import annotations

import signal

import pytest

from melfeed.consumer.app import run_exit_code


@pytest.mark.parametrize(
    ("group_code", "expected"),
    [
        (0, 0),  # the plan finished: the group exited by itself
        (None, 0),  # not reaped (never started): nothing went wrong on its side
        (-signal.SIGTERM, 0),  # the stop ladder's SIGTERM after a signal to run
        (78, 78),  # a producer's contract or configuration error stopped the group
        (1, 1),
        (-signal.SIGKILL, 1),  # killed (OOM killer, or the ladder's last rung): a failure, not 247
        (-signal.SIGSEGV, 1),
    ],
)
def test_run_exits_with_a_documented_code_whatever_ended_its_producer_group(
    group_code: int | None, expected: int
) -> None:
    assert run_exit_code(group_code) == expected
