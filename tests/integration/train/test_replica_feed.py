"""Two replicas fed by the loop's hand-off: each replica's rows from the slot straight to its own device, the
outputs summed on the first replica's device (never the host's), training as the full-batch path does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

_ONE, _TWO = "/job:localhost/replica:0/task:0/device:CPU:1", "/job:localhost/replica:0/task:0/device:CPU:2"


def test_each_replica_gets_its_rows_on_its_device_and_the_outputs_are_summed_there(tmp_path: Path) -> None:
    out = tmp_path / "feed.json"
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path), "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.replica_feed_check", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["piece_devices"] == [[_ONE, _TWO]] * 4  # mel, mel_len, tokens, tok_len: own devices
    # the mel and tokens pieces alias the slot; a replica's share of a length array that starts off a 64-byte
    # boundary (4 rows of int32) is a small host copy: 2 per batch here
    assert r["aliases_slot"] == [[True, True], [True, False], [True, True], [True, False]], r["aliases_slot"]
    assert r["host_copies"] == 2 * 3 and r["transfers"] == 8 * 3
    assert r["accumulator_device"] == _ONE
    # nothing of the program is placed on the host's CPU:0: the sums go to the first replica's device
    assert r["explicit_devices"] == [_ONE, _TWO] and _ONE in r["reduce_devices"], r
    assert r["bit_identical"] and r["variables"] > 0  # the same training as the full-batch path
    assert r["fed_losses_sum"] == r["ref_losses_sum"] > 0
