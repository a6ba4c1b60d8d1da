"""``buckets.batch_size: auto`` with a producer started on its own (a systemd unit, a second host): its config has no
``buckets.rows``, so it learns each bucket's rows from the consumer's WELCOME and builds batches of them; the run
trains to its end and the audit is exact."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from tests import procs

_STEPS = 8


def test_a_producer_on_its_own_learns_the_auto_rows_in_the_handshake_and_the_run_is_exact(
    demo_cache: Path, tmp_path: Path
) -> None:
    state, log = tmp_path / "state", tmp_path / "run.log"
    config = procs.write_config(
        tmp_path / "run.yaml",
        demo_cache,
        f"ipc://{tmp_path}/rows.sock",
        state,
        _STEPS,
        buckets={"num_buckets": 2, "batch_size": "auto", "max_batch_size": 4},
        producer={"count": 1},
        consumer={"feed_efficiency_steps": 0, "warmup_steps": 1, "checkpoint_every_steps": 1000},
    )
    producer = procs.start("producer", config, log)  # the same config: auto, and no rows
    consumer = procs.start("consumer", config, log)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and consumer.poll() is None and producer.poll() is None:
            time.sleep(0.05)
        assert producer.poll() is None, procs.tail(log)  # not exit 78: it joined, and waits for the next consumer
        assert consumer.poll() == 0, procs.tail(log)
    finally:
        procs.stop(consumer)
        procs.stop(producer)
    (entry,) = json.loads((state / "batch_sizes.json").read_text())["entries"].values()
    rows = entry["rows"]
    assert len(rows) == 2 and all(1 <= r <= 4 for r in rows)
    text = log.read_text(errors="replace")
    learned = re.findall(r"joined consumer epoch=\d+ .* rows by bucket (\[[\d, ]+\]) \(the consumer's\)", text)
    assert learned and all(json.loads(r) == rows for r in learned), procs.tail(log)
    rc, doc, out = procs.run_audit(state, tmp_path)
    assert rc == 0 and doc["applied"] == _STEPS and doc["consumer_epochs"] == 1, out
