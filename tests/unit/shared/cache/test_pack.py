"""The packed cache gives the batches the ``.npy`` files give, bit for bit, and refuses rows the same way.

``melfeed pack`` (``shared/cache/pack_write.py``) and the producer's ``PackReader`` (rows copied
out of the mapped pack, or one ``preadv`` per row: ``producer/pack/reader.py``), each way against the
per-file readers as the reference: every array of every batch equal (tails of garbage-filled targets zeroed), in a
bucket that holds every row whole and in one
shorter than most rows (the cut parts go to the reader's sink); float16 packs; rows bad at pack time
quarantined (or failed) like the files' path does; and every pack ``open_pack`` must refuse.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from melfeed.producer.batcher import BatchAssembler
from melfeed.producer.pack.reader import PackReader, open_pack_reader
from melfeed.producer.reader import CacheReader, TransientReadError
from melfeed.shared.cache.demo_data import write_demo_cache
from melfeed.shared.cache.index import build_manifest
from melfeed.shared.cache.manifest import Manifest
from melfeed.shared.cache.pack_format import PackLayout, PackUnusable, open_pack, pack_path
from melfeed.shared.cache.pack_write import write_pack
from melfeed.shared.config import BucketConfig
from melfeed.shared.errors import CacheError
from melfeed.shared.wire.buckets import Bucket, BucketSet, build_buckets

N_MELS = 8
_GARBAGE = 0x7F  # every byte of a target before a build: an un-zeroed tail shows
_OLD_NS = 1_600_000_000 * 10**9  # an mtime no rewrite made now can have
# (bucket, sample ids): whole batches, a partial one (padding rows) and another order.
_BATCHES = [(b, ids) for b in (0, 1) for ids in ([0, 1, 2, 3], [4, 5], [5, 0, 3, 1])]
_BOTH_WAYS = pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "preadv"])


@pytest.fixture
def cache(tmp_path: Path) -> Manifest:
    """6 utterances with four extras, one of each kind (frame, utterance, sequence, token), packed."""
    root = tmp_path / "cache"
    demo = write_demo_cache(root, n_utterances=6, n_mels=N_MELS, extras=True)  # energy: frame, speaker: utterance
    for name in ("ref", "phon"):
        (root / "extras" / name).mkdir()
    for i, u in enumerate(demo.utterances):
        np.save(root / "extras" / "ref" / f"{u.id}.npy", np.arange(2 * (i + 1), dtype=np.float16).reshape(-1, 2) + 1)
        np.save(root / "extras" / "phon" / f"{u.id}.npy", np.arange(u.tokens, dtype=np.int16) * 3 - 7)
    manifest, problems = build_manifest(root, N_MELS, kinds={"ref": "sequence", "phon": "token"})
    assert problems == [] and sorted(c.spec.kind for c in manifest.extras) == [
        "frame",
        "sequence",
        "token",
        "utterance",
    ]
    assert write_pack(manifest, "float32").bad == {}
    return manifest


def _buckets(manifest: Manifest, mel_dtype: str = "float32") -> BucketSet:
    """Bucket 0 holds every row whole; bucket 1 (T=400, L=100, S=3) cuts 5 mels, 5 token rows and 3 refs."""
    full = build_buckets(
        manifest.frames,
        manifest.token_counts,
        N_MELS,
        BucketConfig(num_buckets=1, batch_size=4),
        manifest.schema,
        mel_dtype=mel_dtype,
    )
    whole = full.buckets[0]
    short = Bucket(
        index=1,
        batch_size=4,
        max_frames=400,
        max_tokens=100,
        n_mels=N_MELS,
        extras=whole.extras,
        seq_lengths=(3,),
        mel_dtype=mel_dtype,
    )
    assert (manifest.frames > 400).sum() == 5 and (manifest.token_counts > 100).sum() == 5
    return BucketSet((whole, short), full.assignment, 0, 0, full.real_frames)


def _garbage(bucket: Bucket) -> dict[str, npt.NDArray[np.generic]]:
    dtypes = bucket.dtypes()
    out = {}
    for key, shape in bucket.shapes().items():
        array = np.empty(shape, dtypes[key])
        array.reshape(-1).view(np.uint8)[:] = _GARBAGE
        out[key] = array
    return out


def _assemblers(
    manifest: Manifest, buckets: BucketSet, mel_dtype: str = "float32", policy: str = "quarantine", mapped: bool = True
) -> tuple[BatchAssembler, BatchAssembler]:
    """(per-file, packed) assemblers of the same cache; the pack mapped or read with ``preadv``."""
    pack = open_pack_reader(manifest, "auto", mel_dtype, mapped=mapped)
    assert isinstance(pack, PackReader) and pack.mode == ("mapped" if mapped else "preadv")
    return (
        BatchAssembler(CacheReader(manifest, mel_dtype=mel_dtype), buckets, bad_sample_policy=policy),
        BatchAssembler(CacheReader(manifest, mel_dtype=mel_dtype), buckets, bad_sample_policy=policy, pack=pack),
    )


def _compare_every_batch(
    manifest: Manifest, buckets: BucketSet, mel_dtype: str = "float32", mapped: bool = True
) -> list[list[int]]:
    """Build ``_BATCHES`` both ways into garbage-filled targets; assert equal bytes; the quarantined ids."""
    plain, packed = _assemblers(manifest, buckets, mel_dtype, mapped=mapped)
    quarantined = []
    try:
        for batch_id, (bucket, ids) in enumerate(_BATCHES):
            want = plain.build(batch_id, bucket, ids, target=_garbage(buckets.buckets[bucket]))
            got = packed.build(batch_id, bucket, ids, target=_garbage(buckets.buckets[bucket]))
            assert list(got.arrays) == list(want.arrays)
            for key, value in want.arrays.items():
                assert got.arrays[key].tobytes() == value.tobytes(), (bucket, ids, key)
            assert got.quarantined == want.quarantined, (bucket, ids)
            quarantined.append(want.quarantined)
    finally:
        plain.close()
        packed.close()
    return quarantined


@_BOTH_WAYS
def test_every_batch_from_the_pack_equals_the_files_in_a_whole_and_a_cutting_bucket(
    cache: Manifest, mapped: bool
) -> None:
    buckets = _buckets(cache)
    assert _compare_every_batch(cache, buckets, mapped=mapped) == [[]] * len(_BATCHES)
    _, packed = _assemblers(cache, buckets, mapped=mapped)  # the cuts really happen (the sink path)
    batch = packed.build(0, 1, [0, 1, 2, 3])
    assert list(batch.arrays["mel_len"]) == [302, 400, 400, 400]
    assert list(batch.arrays["tok_len"]) == [76, 100, 100, 100] and list(batch.arrays["ref_len"]) == [1, 2, 3, 3]
    assert batch.arrays["mel"][0, :302].any() and batch.arrays["phon"][3, :100].any()
    packed.close()


@_BOTH_WAYS
def test_a_float16_pack_equals_the_float32_files_cast_and_an_overflow_is_quarantined_alike(
    cache: Manifest, mapped: bool
) -> None:
    assert write_pack(cache, "float16").bad == {}
    buckets = _buckets(cache, "float16")
    assert _compare_every_batch(cache, buckets, "float16", mapped) == [[]] * len(_BATCHES)
    path = cache.mel_path(2)
    mel = np.load(path)
    mel[3, 4] = 1e6  # finite in float32, beyond float16's 65504
    np.save(path, mel)  # same size and header: the manifest still holds
    bad = write_pack(cache, "float16").bad
    assert list(bad) == [2] and bad[2][0] == str(path) and "float16" in bad[2][1], bad
    assert write_pack(cache, "float32").bad == {}  # float32 carries it
    quarantined = _compare_every_batch(cache, buckets, "float16", mapped)
    assert quarantined == [[2], [], [], [2], [], []]


def _damage_rows(manifest: Manifest) -> dict[int, tuple[Path, str]]:
    """A NaN mel, a truncated token file, a missing extra, a token file rewritten (same size and header) with an id
    beyond the manifest's token_range; sample id -> (file, words of its pack reason)."""
    mel_path = manifest.mel_path(1)
    mel = np.load(mel_path)
    mel[1, 1] = np.nan  # frame 1: inside every bucket's kept frames
    np.save(mel_path, mel)
    tok_path = manifest.tokens_path(3)
    tok_path.write_bytes(tok_path.read_bytes()[:-4])
    extra_path = manifest.extra_path("energy", 4)
    extra_path.unlink()
    assert manifest.token_range is not None
    ids_path = manifest.tokens_path(5)
    np.save(ids_path, np.load(ids_path) * 0 + manifest.token_range[1] + 1)  # past model.vocab_size, unchecked
    return {
        1: (mel_path, "non-finite"),
        3: (tok_path, "size"),
        4: (extra_path, "missing"),
        5: (ids_path, "outside the"),
    }


@_BOTH_WAYS
def test_rows_bad_at_pack_time_are_listed_and_quarantined_or_failed_like_the_files(
    cache: Manifest, mapped: bool
) -> None:
    damaged = _damage_rows(cache)
    bad = write_pack(cache, "float32").bad
    assert {i: path for i, (path, _) in bad.items()} == {i: str(p) for i, (p, _) in damaged.items()}
    for i, (_, words) in damaged.items():
        assert words in bad[i][1], bad[i]
    buckets = _buckets(cache)
    assert _compare_every_batch(cache, buckets, mapped=mapped) == [[1, 3], [4, 5], [5, 3, 1]] * 2
    plain, packed = _assemblers(cache, buckets, policy="fail", mapped=mapped)
    for sid, (path, _) in damaged.items():
        for assembler in (plain, packed):
            with pytest.raises(CacheError) as info:
                assembler.build(0, 1, [0, sid])
            assert info.value.path == str(path), (sid, info.value)
    plain.close()
    packed.close()


def _other_manifests_pack(manifest: Manifest, tmp_path: Path) -> str:
    other = write_demo_cache(tmp_path / "other", n_utterances=6, n_mels=N_MELS, extras=True)  # packed by the demo
    shutil.copyfile(pack_path(other.cache_dir, "float32"), pack_path(manifest.cache_dir, "float32"))
    return "float32"


def _touched(manifest: Manifest, tmp_path: Path) -> str:
    st = os.stat(manifest.mel_path(0))
    os.utime(manifest.mel_path(0), ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    return "float32"


def _rewritten(manifest: Manifest, tmp_path: Path) -> str:
    path = manifest.tokens_path(2)
    os.utime(path, ns=(_OLD_NS, _OLD_NS))  # packed with an old mtime: the rewrite's cannot match
    write_pack(manifest, "float32")
    data = path.read_bytes()
    path.write_bytes(data[:-4] + bytes(4))  # same size, other bytes
    return "float32"


def _gone(manifest: Manifest, tmp_path: Path) -> str:
    manifest.extra_path("speaker", 5).unlink()
    return "float32"


def _truncated(manifest: Manifest, tmp_path: Path) -> str:
    path = pack_path(manifest.cache_dir, "float32")
    os.truncate(path, path.stat().st_size - 1)
    return "float32"


def _bad_magic(manifest: Manifest, tmp_path: Path) -> str:
    with open(pack_path(manifest.cache_dir, "float32"), "r+b") as f:
        f.write(b"NOTAPACK")
    return "float32"


def _other_dtype(manifest: Manifest, tmp_path: Path) -> str:
    shutil.copyfile(pack_path(manifest.cache_dir, "float32"), pack_path(manifest.cache_dir, "float16"))
    return "float16"


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (_other_manifests_pack, "written for another manifest"),
        (_touched, "a cache file changed since it was written"),
        (_rewritten, "a cache file changed since it was written"),
        (_gone, "a cache file changed since it was written"),
        (_truncated, "damaged"),
        (_bad_magic, "not a melfeed pack (bad magic)"),
        (_other_dtype, "holds float32 mels, transport.mel_dtype is float16"),
    ],
)
def test_a_pack_that_cannot_serve_the_manifest_is_refused_with_its_reason_and_not_used(
    cache: Manifest, tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: object, reason: str
) -> None:
    fds = len(os.listdir("/proc/self/fd"))
    mel_dtype = damage(cache, tmp_path)  # type: ignore[operator]
    with pytest.raises(PackUnusable) as info:
        open_pack(cache, mel_dtype)
    assert str(info.value).startswith(reason), info.value
    with caplog.at_level(logging.INFO, logger="melfeed.producer.pack.reader"):
        assert open_pack_reader(cache, "auto", mel_dtype) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and reason in warnings[0] and str(pack_path(cache.cache_dir, mel_dtype)) in warnings[0]
    assert len(os.listdir("/proc/self/fd")) == fds  # every refusal closed what it opened


def test_no_pack_is_an_info_line_off_is_silent_and_a_good_pack_is_used(
    cache: Manifest, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="melfeed.producer.pack.reader"):
        assert open_pack_reader(cache, "off", "float32") is None  # a good pack, not wanted
        assert caplog.records == []
        reader = open_pack_reader(cache, "auto", "float32")
        assert isinstance(reader, PackReader) and reader.path == pack_path(cache.cache_dir, "float32")
        reader.close()
        reader.close()  # idempotent
        path = pack_path(cache.cache_dir, "float32")
        assert caplog.records[-1].getMessage() == f"reading the packed cache {path} (mapped; 0 rows listed bad)"
        reader = open_pack_reader(cache, "preadv", "float32")  # the pack, never mapped
        assert isinstance(reader, PackReader) and reader.mode == "preadv"
        reader.close()
        assert caplog.records[-1].getMessage() == f"reading the packed cache {path} (preadv; 0 rows listed bad)"
        caplog.clear()
        pack_path(cache.cache_dir, "float32").unlink()
        assert open_pack_reader(cache, "auto", "float32") is None
    assert [(r.levelno, r.getMessage().split(":")[0]) for r in caplog.records] == [
        (logging.INFO, f"no packed cache at {pack_path(cache.cache_dir, 'float32')}")
    ]


@_BOTH_WAYS
def test_a_pack_cut_in_place_after_it_was_opened_restarts_the_producer_naming_the_pack_never_a_quarantine(
    cache: Manifest, mapped: bool
) -> None:
    buckets = _buckets(cache)
    plain, packed = _assemblers(cache, buckets, policy="quarantine", mapped=mapped)
    path = pack_path(cache.cache_dir, "float32")
    want = plain.build(0, 0, [0, 1, 2, 3], target=_garbage(buckets.buckets[0]))
    got = packed.build(0, 0, [0, 1, 2, 3], target=_garbage(buckets.buckets[0]))
    for key, value in want.arrays.items():
        assert got.arrays[key].tobytes() == value.tobytes(), key
    size = path.stat().st_size
    os.truncate(path, int(PackLayout.of(cache, "float32").offsets[5]) + 10)  # record 5 cut, 0..4 whole
    with pytest.raises(TransientReadError) as info:  # the worker's exit 1: restart, reopen, refuse
        packed.build(1, 0, [4, 5])
    assert info.value.path == str(path) and f"changed size while open ({size} -> " in info.value.reason
    packed.close()
    plain.close()


def test_a_pack_that_reads_short_under_preadv_is_the_packs_fault_not_the_rows(
    cache: Manifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    buckets = _buckets(cache)
    _, packed = _assemblers(cache, buckets, policy="quarantine", mapped=False)
    reader = packed._pack
    assert reader is not None
    packed.build(0, 0, [4, 5])
    monkeypatch.setattr(reader, "check_intact", lambda: None)  # cut between the batch's check and the read
    os.truncate(reader.path, int(PackLayout.of(cache, "float32").offsets[5]) + 10)
    packed.build(1, 0, [4])  # record 4 is whole
    with pytest.raises(TransientReadError) as info:
        packed.build(2, 0, [4, 5])
    assert info.value.path == str(reader.path) and "short read at record 5" in info.value.reason
    packed.close()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("on", "producer.pack: must be 'auto', 'preadv' or 'off', got 'on'"),
        ("", "producer.pack: must be 'auto', 'preadv' or 'off', got ''"),
        (
            False,
            'producer.pack: must be a string (YAML read a bare off/on/yes/no as a boolean: quote it, e.g. "off"), '
            "got False",
        ),  # YAML's unquoted off
    ],
)
def test_producer_pack_is_auto_by_default_accepts_preadv_and_off_and_refuses_anything_else(
    value: object, message: str
) -> None:
    from melfeed.shared.config.loader import config_from_mapping
    from melfeed.shared.errors import ConfigError

    assert config_from_mapping({}).producer.pack == "auto"
    assert config_from_mapping({"producer": {"pack": "off"}}).producer.pack == "off"
    assert config_from_mapping({"producer": {"pack": "preadv"}}).producer.pack == "preadv"
    with pytest.raises(ConfigError) as info:
        config_from_mapping({"producer": {"pack": value}})
    assert str(info.value) == message


def test_a_pack_that_cannot_be_written_is_one_line_naming_the_cache_and_leaves_nothing(
    cache: Manifest, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse
    import errno

    import melfeed.shared.cache.pack_write as pack_write

    def full_disk(fd: int) -> None:  # the pack's data cannot reach the disk
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)
    before = sorted(os.listdir(cache.cache_dir))
    args = argparse.Namespace(cache_dir=str(cache.cache_dir), n_mels=cache.n_mels, mel_dtype="float16")
    with pytest.raises(CacheError) as info:
        pack_write.main_pack(args)
    assert str(info.value) == f"{cache.cache_dir}: pack not written (No space left on device)"
    assert sorted(os.listdir(cache.cache_dir)) == before  # no temp file, no float16 pack
