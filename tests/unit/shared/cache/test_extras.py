"""Extra arrays in a cache: manifest declarations (bad ones: one line naming file and key, exit 78),
fingerprint, ``index --extra`` and ``verify-cache`` on bad extras."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from melfeed import cli as run_pipeline
from melfeed.shared.cache.demo_data import write_demo_cache
from melfeed.shared.cache.manifest import load_manifest
from melfeed.shared.cache.verify import verify_cache
from melfeed.shared.errors import CacheError

N = 6
REPO = Path(__file__).resolve().parents[4]


@pytest.fixture(autouse=True)
def _keep_logging(monkeypatch: pytest.MonkeyPatch) -> None:
    """``melfeed.cli.main`` in-process must not replace the test session's log handlers."""
    monkeypatch.setattr("melfeed.shared.service.lifecycle.setup_logging", lambda *args, **kwargs: None)


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_cache(tmp_path_factory.mktemp("extras") / "cache", N, n_mels=8, extras=True).cache_dir


@pytest.fixture()
def cache(source: Path, tmp_path: Path) -> Path:
    path = tmp_path / "cache"
    shutil.copytree(source, path)
    return path


def _doc(cache: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((cache / "manifest.json").read_text())
    return doc


def _write(cache: Path, doc: dict) -> None:  # type: ignore[type-arg]
    (cache / "manifest.json").write_text(json.dumps(doc))


def test_the_demo_extras_are_declared_and_fingerprinted_and_a_cache_without_them_is_unchanged(
    cache: Path, tmp_path: Path
) -> None:
    manifest = load_manifest(cache)
    assert [(c.spec.name, c.spec.kind, c.spec.dtype, c.spec.shape) for c in manifest.extras] == [
        ("energy", "frame", "float32", ()),
        ("speaker", "utterance", "int32", ()),
    ]
    assert manifest.extras[0].rows[:, 0].tolist() == manifest.frames.tolist()
    plain = write_demo_cache(tmp_path / "plain", N, n_mels=8)
    assert "extras" not in _doc(plain.cache_dir) and plain.extras == ()
    assert plain.fingerprint != manifest.fingerprint  # the schema is part of the plan identity
    assert [u.id for u in plain.utterances] == [u.id for u in manifest.utterances]
    assert plain.mel_path(3).read_bytes() == manifest.mel_path(3).read_bytes()  # same random stream
    mel = np.load(manifest.mel_path(3))
    assert np.load(manifest.extra_path("energy", 3)).tobytes() == mel.mean(axis=1, dtype=np.float32).tobytes()
    assert np.load(manifest.extra_path("speaker", 3)).shape == ()


@pytest.mark.parametrize(
    ("edit", "key"),
    [
        (lambda e: e[0].update(kind="per_frame"), "extras[0].kind"),
        (lambda e: e[1].update(dtype="float64"), "extras[1].dtype"),
        (lambda e: e[0].update(name="mel_len"), "extras[0].name"),
        (lambda e: e[1].update(shape=[0]), "extras[1].shape"),
        (lambda e: e[1].update(rows=e[1]["rows"][:-1]), "extras[1].rows"),
        (lambda e: e[0]["rows"][2].__setitem__(0, 1), "extras[0].rows"),  # a frame extra with another length
        (lambda e: e[0].update(name="speaker"), "extras[1].name"),  # declared twice
        (lambda e: e[0].pop("dtype"), "extras[0]"),
    ],
)
def test_a_bad_declaration_is_one_line_naming_the_manifest_and_the_key_and_exits_78(
    cache: Path, edit: object, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = _doc(cache)
    edit(doc["extras"])  # type: ignore[operator]
    _write(cache, doc)
    with pytest.raises(CacheError) as err:
        load_manifest(cache)
    text = str(err.value)
    assert "\n" not in text and text.startswith(str(cache / "manifest.json")) and f" {key}" in text
    assert (
        run_pipeline.main(["verify-cache", "--cache-dir", str(cache), "--n-mels", "8"]) == 1
    )  # reported, then by header
    assert f"{key}: " in capsys.readouterr().out


def test_a_run_on_a_badly_declared_cache_exits_78_with_one_line(cache: Path, tmp_path: Path) -> None:
    doc = _doc(cache)
    doc["extras"][0]["kind"] = "per_frame"
    _write(cache, doc)
    config = tmp_path / "melfeed.yaml"
    config.write_text(f"cache_dir: {cache}\nn_mels: 8\n")
    proc = subprocess.run(
        [sys.executable, "-m", "melfeed", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "XDG_RUNTIME_DIR": str(tmp_path)},
    )
    assert proc.returncode == 78, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last == (
        f"melfeed run: {cache / 'manifest.json'}: malformed manifest: extras[0].kind: "
        "must be one of ['frame', 'token', 'utterance', 'sequence', 'matrix'], got 'per_frame'"
    )


def test_index_adopts_extra_folders_with_a_declared_or_inferred_kind(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    manifest = load_manifest(cache)
    durations, refs = tmp_path / "durations", tmp_path / "refs"
    durations.mkdir()
    refs.mkdir()
    for i, u in enumerate(manifest.utterances):
        np.save(durations / f"{u.id}.npy", np.full(u.tokens, i, np.int32))
        np.save(refs / f"{u.id}.npy", np.zeros((i + 1, 2), np.float16))
    code = run_pipeline.main(
        [
            "index",
            "--cache-dir",
            str(cache),
            "--n-mels",
            "8",
            "--extra",
            f"duration={durations}",
            "--extra",
            f"ref:sequence={refs}",
        ]
    )
    assert code == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "extra duration: kind token, dtype int32, shape []" in out
    assert "extra ref: kind sequence, dtype float16, shape [2]" in out
    again = load_manifest(cache)
    assert (cache / "extras" / "duration").resolve() == durations.resolve()
    assert again.schema.sequence_lengths["ref"].tolist() == list(range(1, N + 1))
    assert verify_cache(cache, 8).bad == ()


@pytest.mark.parametrize("arg", ["duration", "=dir", "Bad=dir", "x:per_frame=dir", "mel=dir"])
def test_a_malformed_extra_argument_is_one_line_and_exits_78(
    cache: Path, arg: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_pipeline.main(["index", "--cache-dir", str(cache), "--n-mels", "8", "--extra", arg]) == 78
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--extra" in err[0]


def test_index_leaves_out_an_utterance_whose_extra_is_bad(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ids = [u.id for u in load_manifest(cache).utterances]
    np.save(cache / "extras" / "energy" / f"{ids[1]}.npy", np.zeros(3, np.float32))  # not one per frame
    (cache / "extras" / "speaker" / f"{ids[2]}.npy").unlink()
    assert run_pipeline.main(["index", "--cache-dir", str(cache), "--n-mels", "8"]) == 1
    err = capsys.readouterr().err
    assert f"energy/{ids[1]}.npy: frame extra has 3 rows" in err and f"speaker/{ids[2]}.npy: missing" in err
    assert run_pipeline.main(["index", "--cache-dir", str(cache), "--n-mels", "8", "--skip-bad"]) == 0
    assert [u.id for u in load_manifest(cache).utterances] == [ids[0], *ids[3:]]


def test_verify_cache_reports_each_bad_extra_file_by_path(cache: Path) -> None:
    ids = [u.id for u in load_manifest(cache).utterances]
    energy = cache / "extras" / "energy"
    values = np.load(energy / f"{ids[0]}.npy")
    values[1] = np.nan
    np.save(energy / f"{ids[0]}.npy", values)  # same size, NaN
    np.save(energy / f"{ids[1]}.npy", np.load(energy / f"{ids[1]}.npy")[:-1])  # truncated
    np.save(cache / "extras" / "speaker" / f"{ids[2]}.npy", np.array(1, np.int64))  # other dtype
    (cache / "extras" / "speaker" / f"{ids[3]}.npy").unlink()
    report = verify_cache(cache, 8)
    got = {Path(p.path).relative_to(cache).as_posix(): p.reason for p in report.bad}
    assert got.keys() == {
        f"extras/energy/{ids[0]}.npy",
        f"extras/energy/{ids[1]}.npy",
        f"extras/speaker/{ids[2]}.npy",
        f"extras/speaker/{ids[3]}.npy",
    }
    assert "NaN" in got[f"extras/energy/{ids[0]}.npy"]
    assert "frame extra has" in got[f"extras/energy/{ids[1]}.npy"]
    assert "dtype <i8" in got[f"extras/speaker/{ids[2]}.npy"]
    assert "missing" in got[f"extras/speaker/{ids[3]}.npy"]
    assert report.files == 2 * N + 2 * N
