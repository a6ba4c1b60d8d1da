"""``buckets.cost: measured`` with a producer started on its own (a systemd unit, a second host): it has no shapes
until the consumer's WELCOME gives the weights the consumer planned with and the shapes they make; it plans its own
with those weights, finds them the consumer's, builds them, and the run trains to its end with an exact audit.

The consumer's config resolves the weights as ``cost: formula`` (what a measuring consumer turns into); they are
chosen so that they plan other shapes than the producer's own configured weights would. A producer whose own
settings plan other shapes with those weights refuses that consumer: exit 78, one line naming both plans."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

from melfeed.shared.cache.manifest import load_manifest
from melfeed.shared.config import BucketConfig
from tests import procs

_STEPS = 8
_BUCKETS = {"max_shapes": 2, "batch_size": 4}  # two shapes: two compiles of the tiny step
_COSTS = {"token_cost": 100.0, "attention_cost": 0.002}  # the consumer's: the producer's config keeps the defaults


def _plan(cache: Path, **costs: float) -> list[list[int]]:
    from melfeed.shared.wire.buckets import build_buckets

    manifest = load_manifest(cache)
    cfg = dataclasses.replace(BucketConfig(**_BUCKETS), **costs)  # type: ignore[arg-type]
    return build_buckets(manifest.frames, manifest.token_counts, 80, cfg).as_wire()


def test_a_producer_on_its_own_learns_the_measured_costs_in_the_handshake_and_the_run_is_exact(
    demo_cache: Path, tmp_path: Path
) -> None:
    consumers = _plan(demo_cache, **_COSTS)
    assert consumers != _plan(demo_cache)  # a producer planning with its own weights would build other shapes
    state, log = tmp_path / "state", tmp_path / "run.log"
    sections = {
        "producer": {"count": 1},
        "consumer": {"feed_efficiency_steps": 0, "warmup_steps": 1, "checkpoint_every_steps": 1000},
    }
    endpoint = f"ipc://{tmp_path}/costs.sock"
    consumer_cfg = procs.write_config(
        tmp_path / "consumer.yaml", demo_cache, endpoint, state, _STEPS, buckets={**_BUCKETS, **_COSTS}, **sections
    )
    producer_cfg = procs.write_config(
        tmp_path / "producer.yaml",
        demo_cache,
        endpoint,
        state,
        _STEPS,
        buckets={**_BUCKETS, "cost": "measured"},
        **sections,
    )
    producer = procs.start("producer", producer_cfg, log)
    consumer = procs.start("consumer", consumer_cfg, log)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and consumer.poll() is None and producer.poll() is None:
            time.sleep(0.05)
        assert producer.poll() is None, procs.tail(log)  # not exit 78: it joined, and waits for the next consumer
        assert consumer.poll() == 0, procs.tail(log)
    finally:
        procs.stop(consumer)
        procs.stop(producer)
    text = log.read_text(errors="replace")
    [(epoch, bound)] = re.findall(r"consumer bound \S+ epoch=(\d+) buckets=(\[\[.*?\]\]) ", text)
    assert json.loads(bound) == consumers, procs.tail(log)
    learned = re.findall(r"plan learned from consumer (\d+): token_cost 100 attention_cost 0.002, (\d+) shapes", text)
    # Once per join (a consumer busy importing TensorFlow may go silent long enough for a re-join): its epoch each time.
    assert learned and set(learned) == {(epoch, str(len(consumers)))}, procs.tail(log)
    assert re.search(r"producer joined id=producer-\d+ .* plan=learned", text), procs.tail(log)
    rc, doc, out = procs.run_audit(state, tmp_path)
    assert rc == 0 and doc["applied"] == _STEPS and doc["consumer_epochs"] == 1, out


_CONSUMER = """\
import sys
from melfeed.consumer.feed import Consumer
from melfeed.shared.config.loader import load_config
from melfeed.shared.service.lifecycle import setup_logging, stop_on_signals
setup_logging("INFO")
with stop_on_signals() as stop, Consumer(load_config(sys.argv[1])) as feed:
    feed.start()
    stop.wait(60)                             # answers HELLOs until the test stops it (SIGTERM: a clean close)
"""


def test_a_producer_whose_own_plan_with_the_consumers_costs_differs_refuses_it_with_78_naming_both(
    demo_cache: Path, tmp_path: Path
) -> None:
    consumers = _plan(demo_cache, **_COSTS)
    state, log = tmp_path / "state", tmp_path / "run.log"
    endpoint = f"ipc://{tmp_path}/refused.sock"
    consumer_cfg = procs.write_config(
        tmp_path / "consumer.yaml", demo_cache, endpoint, state, _STEPS, buckets={**_BUCKETS, **_COSTS}
    )
    producer_cfg = procs.write_config(  # another setting on the producer's host: three shapes allowed, not two
        tmp_path / "producer.yaml",
        demo_cache,
        endpoint,
        state,
        _STEPS,
        buckets={**_BUCKETS, "max_shapes": 3, "cost": "measured"},
        producer={"count": 1},
    )
    consumer = procs.start_python(_CONSUMER, consumer_cfg, log)  # the feed alone: no TensorFlow
    producer = procs.start("producer", producer_cfg, log)
    try:
        assert producer.wait(procs.WAIT_S) == 78, procs.tail(log)
        assert consumer.poll() is None, procs.tail(log)
    finally:
        procs.stop(producer)
        stopped = procs.stop(consumer)
    assert stopped == 0 and not procs.slot_files([consumer.pid]), procs.tail(log)  # closed, its slot files gone
    [line] = [x for x in log.read_text(errors="replace").splitlines() if "refusing consumer" in x]
    assert f"its WELCOME plans shapes {consumers} with token_cost 100 attention_cost 0.002" in line
    assert "this producer plans [[0, 4, " in line and "(another cache, version or bucket setting)" in line
