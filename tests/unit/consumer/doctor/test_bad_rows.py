"""doctor on a cache with bad files: stage 1 counts the rows it found quarantined (never read, so they flatter
the build rate); past ``producer.max_quarantined_fraction`` doctor stops with one line instead of a verdict."""

from __future__ import annotations

from pathlib import Path

import pytest

from melfeed.consumer.doctor.command import _bad_rows
from melfeed.producer.probe import measure
from melfeed.shared.cache.demo_data import write_demo_cache
from melfeed.shared.config.loader import config_from_mapping
from melfeed.shared.errors import CacheError


def test_the_build_probe_counts_the_rows_it_quarantined(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    write_demo_cache(cache, n_utterances=40)
    for pack in cache.glob("melfeed-*.pack"):
        pack.unlink()
    for mel in (cache / "mels").glob("*.npy"):  # mels/ emptied after indexing: every row is a bad file
        mel.unlink()
    config = tmp_path / "doctor.yaml"
    config.write_text(f"cache_dir: {cache}\nbuckets:\n  batch_size: 8\n", encoding="utf-8")
    result = measure(str(config), 0.0, 0.0, None, 0)
    assert result["rows_read"] and result["rows_quarantined"] == result["rows_read"]
    assert "mels/" in str(result["quarantine_note"])


def test_bad_rows_past_the_runs_ceiling_stop_doctor_with_one_line_naming_the_cache() -> None:
    cfg = config_from_mapping({"cache_dir": "/data/cache"})  # max_quarantined_fraction 0.01
    with pytest.raises(CacheError) as err:
        _bad_rows(cfg, {"rows_read": 40, "rows_quarantined": 40, "quarantine_note": "/data/cache/mels/a.npy: missing"})
    text = str(err.value)
    assert text.startswith("/data/cache: 40 of the 40 rows") and "verify-cache --cache-dir /data/cache" in text
    assert "producer.max_quarantined_fraction (1%)" in text and "\n" not in text


def test_a_few_bad_rows_are_a_note_and_none_are_nothing() -> None:
    cfg = config_from_mapping({"cache_dir": "/data/cache", "producer": {"max_quarantined_fraction": 0.5}})
    note = _bad_rows(cfg, {"rows_read": 100, "rows_quarantined": 3, "quarantine_note": "x.npy: truncated"})
    assert note is not None and note.startswith("3 of the 100 rows") and "too high" in note
    assert _bad_rows(cfg, {"rows_read": 100, "rows_quarantined": 0, "quarantine_note": ""}) is None
