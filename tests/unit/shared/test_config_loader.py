"""Config loading: YAML files, mappings both ways, dotted overrides; errors name the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from melfeed.shared.config import PipelineConfig
from melfeed.shared.config.loader import config_from_mapping, config_to_mapping, load_config, with_overrides
from melfeed.shared.errors import ConfigError


def test_defaults_are_valid_and_round_trip() -> None:
    cfg = PipelineConfig()
    assert config_from_mapping(config_to_mapping(cfg)) == cfg


def test_load_config_reports_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("consumer: [\n")
    with pytest.raises(ConfigError, match="invalid YAML at line"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")


def test_yaml_file_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("seed: 3\nproducer:\n  count: 2\nbuckets:\n  boundaries: [400, 800]\n")
    cfg = load_config(path)
    assert cfg.seed == 3 and cfg.buckets.boundaries == (400, 800)
    cfg2 = with_overrides(cfg, {"producer.count": 5, "seed": None})
    assert cfg2.producer.count == 5 and cfg2.seed == 3
    with pytest.raises(ConfigError, match="producer.count: must be in 1..64, got 0"):
        with_overrides(cfg, {"producer.count": 0})


def _leaves(mapping: dict[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in mapping.items():
        out.update(_leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return out


def test_the_deploy_example_holds_every_key_with_its_default_and_trains_until_stopped() -> None:
    example = Path(__file__).resolve().parents[3] / "deploy" / "example.yaml"
    shown = _leaves(yaml.safe_load(example.read_text(encoding="utf-8")))
    defaults = _leaves(config_to_mapping(PipelineConfig()))
    assert sorted(set(defaults) - set(shown)) == [], "keys missing from deploy/example.yaml"
    assert sorted(set(shown) - set(defaults)) == [], "keys in deploy/example.yaml that the config does not have"
    differs = {key for key in defaults if shown[key] != defaults[key]}
    # cache_dir has no default (shown with a typical value); a service trains until stopped (steps null)
    assert differs == {"cache_dir", "consumer.steps"}, differs
    cfg = load_config(example)
    assert (cfg.cache_dir, cfg.consumer.steps) == ("/var/lib/melfeed/cache", None)


@pytest.mark.parametrize(
    ("text", "hinted"), [("1e-2", True), ("1.0e2", True), ("5E3", True), ("nan", False), ("fast", False)]
)
def test_a_number_yaml_reads_as_a_string_gets_a_hint(tmp_path: Path, text: str, hinted: bool) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"producer:\n  max_quarantined_fraction: {text}\n")
    with pytest.raises(ConfigError, match="producer.max_quarantined_fraction: must be a number") as info:
        load_config(path)
    assert ("write it with a dot and a signed exponent, 1.0e-2" in str(info.value)) == hinted
