"""Tests for melfeed.shared.cache.demo_data: determinism, LJSpeech-like shape, learnable text -> mel, reuse."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from melfeed.shared.cache import demo_data
from melfeed.shared.cache.demo_data import DEMO_MARKER, DEMO_VOCAB_SIZE, demo_utterance_id, write_demo_cache
from melfeed.shared.cache.manifest import Manifest, load_manifest
from melfeed.shared.errors import CacheError, ConfigError
from tests.cli_run import refusal, run_cli


@pytest.fixture(scope="module")
def demo200(tmp_path_factory: pytest.TempPathFactory) -> Manifest:
    return write_demo_cache(tmp_path_factory.mktemp("demo200"), 200, seed=7)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*.npy"))}


def test_same_params_give_byte_identical_files(tmp_path: Path) -> None:
    a = write_demo_cache(tmp_path / "a", 12, seed=3, n_mels=16)
    b = write_demo_cache(tmp_path / "b", 12, seed=3, n_mels=16)
    assert a.fingerprint == b.fingerprint
    files_a = _files(tmp_path / "a")
    assert len(files_a) == 24 and files_a == _files(tmp_path / "b")
    manifests = [(tmp_path / d / "manifest.json").read_bytes() for d in ("a", "b")]
    assert manifests[0] == manifests[1]


def test_different_seed_gives_different_data(tmp_path: Path) -> None:
    a = write_demo_cache(tmp_path / "a", 12, seed=3, n_mels=16)
    b = write_demo_cache(tmp_path / "b", 12, seed=4, n_mels=16)
    assert a.fingerprint != b.fingerprint


def test_ids_look_like_ljspeech(demo200: Manifest) -> None:
    assert demo200.utterances[0].id == "LJ001-0001"
    assert demo_utterance_id(299) == "LJ001-0300"
    assert demo_utterance_id(300) == "LJ002-0001"


def test_lengths_are_ljspeech_like(demo200: Manifest) -> None:
    frames, tokens = demo200.frames, demo200.token_counts
    assert len(demo200) == 200
    assert frames.min() >= 100 and frames.max() <= 870
    assert tokens.min() >= 20 and tokens.max() <= 190
    assert 500 <= frames.mean() <= 640
    assert frames.std() > 100  # a spread of lengths, so bucketing has work to do
    ratio = frames / tokens
    assert 4.0 <= np.median(ratio) <= 5.0
    assert np.corrcoef(frames, tokens)[0, 1] > 0.9


def test_files_have_promised_dtypes_and_value_shape(demo200: Manifest) -> None:
    for i in (0, 57, 199):
        mel = np.load(demo200.mel_path(i))
        tok = np.load(demo200.tokens_path(i))
        assert mel.dtype == np.float32 and mel.shape == (demo200.frames[i], 80)
        assert tok.dtype == np.int32 and tok.shape == (demo200.token_counts[i],)
        assert tok.min() >= 1 and tok.max() < DEMO_VOCAB_SIZE
        assert mel.min() >= -11.5 and mel.max() <= 2.0
        spectrum = mel.mean(axis=0)
        assert spectrum[:10].mean() > spectrum[-10:].mean() + 2.0  # low bins louder
        bin_step = np.abs(np.diff(mel, axis=1)).mean()
        assert bin_step < 0.5 * mel.std()  # smooth across bins (noise aside)


def _token_spectra(manifest: Manifest, indices: range) -> np.ndarray:
    """Mean mel of the frames showing each token id, float64 [V, n_mels]."""
    sums = np.zeros((DEMO_VOCAB_SIZE, manifest.n_mels))
    counts = np.zeros(DEMO_VOCAB_SIZE)
    for i in indices:
        mel, tok = np.load(manifest.mel_path(i)), np.load(manifest.tokens_path(i))
        shown = tok[np.arange(len(mel)) * len(tok) // len(mel)]
        np.add.at(sums, shown, mel)
        np.add.at(counts, shown, 1)
    return sums / np.maximum(counts, 1)[:, None]


def test_mels_are_predictable_from_tokens(demo200: Manifest) -> None:
    """Spectra learned from half the utterances predict the other half's mels well."""
    learned = _token_spectra(demo200, range(0, 100))
    errors, spreads = [], []
    for i in range(100, 110):
        mel, tok = np.load(demo200.mel_path(i)), np.load(demo200.tokens_path(i))
        predicted = learned[tok[np.arange(len(mel)) * len(tok) // len(mel)]]
        errors.append(np.mean((mel - predicted) ** 2))
        spreads.append(np.mean((mel - mel.mean(axis=0)) ** 2))
    assert np.mean(errors) < 0.5 * np.mean(spreads)


def test_second_call_reuses_cache_without_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = write_demo_cache(tmp_path, 10, n_mels=16)

    def _fail(*args: object) -> None:
        raise AssertionError("regenerated instead of reusing")

    monkeypatch.setattr(demo_data, "_utterance", _fail)
    again = write_demo_cache(tmp_path, 10, n_mels=16)
    assert again == first
    assert json.loads((tmp_path / DEMO_MARKER).read_text())["n_utterances"] == 10


def test_changed_params_rewrite_and_drop_stale_files(tmp_path: Path) -> None:
    write_demo_cache(tmp_path, 10, n_mels=16)
    smaller = write_demo_cache(tmp_path, 4, n_mels=16)
    assert len(smaller) == 4
    assert len(list((tmp_path / "mels").glob("*.npy"))) == 4
    assert load_manifest(tmp_path, 16) == smaller


def test_broken_manifest_triggers_rewrite(tmp_path: Path) -> None:
    first = write_demo_cache(tmp_path, 5, n_mels=16)
    (tmp_path / "manifest.json").write_text("{}")
    assert write_demo_cache(tmp_path, 5, n_mels=16) == first


def test_a_demo_cache_indexed_before_token_range_is_rewritten_so_its_runs_check_the_ids(tmp_path: Path) -> None:
    from melfeed.shared.cache.manifest import write_manifest

    first = write_demo_cache(tmp_path, 5, n_mels=16)
    assert first.token_range is not None and 1 <= first.token_range[0] <= first.token_range[1] < DEMO_VOCAB_SIZE
    write_manifest(Manifest(tmp_path, 16, first.utterances))  # a manifest without token_range
    assert write_demo_cache(tmp_path, 5, n_mels=16) == first


def test_refuses_to_write_over_a_real_cache(tmp_path: Path) -> None:
    (tmp_path / "mels").mkdir()
    np.save(tmp_path / "mels" / "real-0001.npy", np.zeros((3, 16), np.float32))
    with pytest.raises(CacheError, match="not a demo cache"):
        write_demo_cache(tmp_path, 5, n_mels=16)
    assert (tmp_path / "mels" / "real-0001.npy").exists()


@pytest.mark.parametrize("n", [0, -5, demo_data.DEMO_UTTERANCES_MAX + 1, 10**20])
def test_a_count_out_of_range_is_refused_naming_the_flag_before_anything_is_written(tmp_path: Path, n: int) -> None:
    with pytest.raises(ConfigError, match=f"^--demo-utterances: must be in 1..1000000, got {n}$"):
        write_demo_cache(tmp_path / "d", n)  # 10**20 would otherwise loop over 10**20 ids
    with pytest.raises(ConfigError, match="^--utterances: "):
        write_demo_cache(tmp_path / "d", n, utterances_flag="--utterances")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("seed", [-1, 2**63])
def test_a_seed_out_of_range_is_refused_naming_the_flag(tmp_path: Path, seed: int) -> None:
    with pytest.raises(ConfigError, match=f"^--seed: must be in 0..{2**63 - 1} "):
        write_demo_cache(tmp_path / "d", 3, seed=seed)  # numpy's traceback for -1 before
    assert write_demo_cache(tmp_path / "d", 3, seed=2**63 - 1, n_mels=8).n_mels == 8  # the bound itself is fine


def test_rejects_nonsense_mel_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        write_demo_cache(tmp_path, 3, n_mels=0)


def test_a_file_or_an_impossible_directory_is_one_cache_error_and_no_lock_file_beside_it(tmp_path: Path) -> None:
    a_file = tmp_path / "passwd"
    a_file.write_text("root:x:0:0\n")
    with pytest.raises(CacheError, match=f"^{a_file}: not a directory$"):
        write_demo_cache(a_file, 3)
    with pytest.raises(CacheError, match=f"^{a_file}: not a directory$"):
        write_demo_cache(a_file / "demo", 3)  # the file in the way is named
    with pytest.raises(CacheError, match=f"^{a_file}/melfeed: cannot create the directory.*Not a directory"):
        write_demo_cache(a_file / "melfeed" / "demo", 3)  # XDG_CACHE_HOME naming a file
    with pytest.raises(CacheError, match="^/proc/melfeed-demo: cannot create the directory"):
        write_demo_cache("/proc/melfeed-demo", 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["passwd"] and a_file.read_text() == "root:x:0:0\n"


def test_a_demo_json_nested_too_deeply_is_rewritten(tmp_path: Path) -> None:
    first = write_demo_cache(tmp_path, 3, n_mels=8)
    (tmp_path / DEMO_MARKER).write_text("[" * 100_000 + "]" * 100_000)
    assert write_demo_cache(tmp_path, 3, n_mels=8) == first


@pytest.mark.parametrize(
    "args, flag",
    [
        (["demo-data", "--cache-dir", "{d}", "--utterances", "0"], "--utterances"),
        (["demo-data", "--cache-dir", "{d}", "--seed", "-1"], "--seed"),
        (["run", "--demo", "--demo-utterances", "0"], "--demo-utterances"),
        (["doctor", "--demo", "--demo-utterances", "-5"], "--demo-utterances"),
    ],
)
def test_the_cli_refuses_a_bad_count_or_seed_with_one_line(tmp_path: Path, args: list[str], flag: str) -> None:
    proc = run_cli(*(a.format(d=tmp_path / "d") for a in args), env={"XDG_CACHE_HOME": str(tmp_path)})
    assert refusal(proc, args[0]).startswith(f"{flag}: must be in ")
    assert not (tmp_path / "d").exists() and not (tmp_path / "melfeed").exists()


def test_the_cli_names_a_read_only_parent_with_the_os_reason(tmp_path: Path) -> None:
    parent = tmp_path / "ro"
    parent.mkdir(mode=0o555)
    assert (
        refusal(
            run_cli("demo-data", "--cache-dir", str(parent / "d"), "--utterances", "3", unprivileged=True), "demo-data"
        )
        == f"{parent / 'd'}: cannot create the directory (Permission denied)"
    )
    home = tmp_path / "home-file"
    home.write_text("")
    line = refusal(run_cli("run", "--demo", "--demo-utterances", "3", env={"XDG_CACHE_HOME": str(home)}), "run")
    assert line == f"{home}/melfeed/demo: cannot create the directory (Not a directory)"


def test_a_second_writer_waits_for_the_first_and_gives_up_after_its_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fcntl
    import os

    root = tmp_path / "demo"
    fd = os.open(tmp_path / ".demo.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another writer holds the cache
    monkeypatch.setattr(demo_data, "_LOCK_WAIT_S", 0.3)
    try:
        with pytest.raises(CacheError, match="another process has been writing this demo cache"):
            write_demo_cache(root, n_utterances=3)
        assert not root.exists()  # nothing written while the other writer held it
    finally:
        os.close(fd)
    assert len(write_demo_cache(root, n_utterances=3).utterances) == 3  # the lock is free again


def test_a_relative_xdg_cache_home_is_ignored(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """XDG spec: a relative path is invalid; it would put the demo cache under each working directory."""
    from melfeed.shared.cache.demo_data import default_demo_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "rel")
    assert default_demo_dir(40) == tmp_path / ".cache" / "melfeed" / "demo" / "40"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_demo_dir(40) == tmp_path / "x" / "melfeed" / "demo" / "40"
