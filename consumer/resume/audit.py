"""The applied-batch audit log and ``melfeed audit STATE_DIR``.

Role: after the fact, anyone can check docs/design.md invariant 3 (every planned batch applied exactly
once, in plan order) from the state directory alone. The consumer appends one fixed-width record
per applied batch *after* the step that read it finished::

    BBBBBBBBBBBB SSSSSSSSSSSS EEEEEEEEEEEEEEEE CCCCCCCC\\n
    batch id     step (1..)   consumer epoch   crc32 of the batch's planned sample ids (hex)

A consumer that is one rank of a multi-worker job records its own steps as batch ids (its share of
the plan, ``consumer/flow/shards.py``); ``run.json`` names its rank and world, and the audit of its
directory checks it against that share. ``job_audit.py`` checks the union of several ranks.

Invariants:
    * Records are fixed width (``RECORD_BYTES``), so "the first n records" is a byte offset and a
      torn last record after a crash is cut off by the truncation on resume.
    * The log is fsynced before a checkpoint that counts its records is committed, so a checkpoint
      never counts a record the disk does not hold.
    * On resume the log is truncated to the checkpoint's record count: batches applied after that
      checkpoint were applied to a model state that was lost, and are applied again.
Shutdown: ``AuditLog.close()`` is idempotent.
"""

from __future__ import annotations

import argparse
import json
import os
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from melfeed.consumer.resume.filemode import STATE_FILE_MODE
from melfeed.shared.errors import ConfigError, StateError
from melfeed.shared.flag_checks import check_output_file, read_regular_file
from melfeed.shared.output_files import write_output

__all__ = [
    "RECORD_BYTES",
    "AuditLog",
    "AuditRecord",
    "AuditResult",
    "analyse",
    "audit_state_dir",
    "main_audit",
    "print_result",
    "read_records",
    "read_run_identity",
    "sample_digest",
    "write_json",
]

AUDIT_NAME = "audit.log"
RUN_NAME = "run.json"
_MAX_RUN_JSON_BYTES = 1 << 20  # run.json is a few hundred bytes: the plan's identity
_FMT = "{:012d} {:012d} {:016x} {:08x}\n"
RECORD_BYTES = len(_FMT.format(0, 0, 0, 0))


def sample_digest(sample_ids: Sequence[int]) -> int:
    """crc32 of the sample ids as little-endian int32: ties a record to the plan's content."""
    return zlib.crc32(np.asarray(sample_ids, dtype="<i4").tobytes())


@dataclass(frozen=True, slots=True)
class AuditRecord:
    batch_id: int
    step: int
    run_id: int  # the consumer start that applied it (the log's "consumer epoch" column)
    digest: int


class AuditLog:
    """Append-only record file; one owner (the consumer's state directory)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW, STATE_FILE_MODE
        )  # whatever the umask; never through a link
        self.records = os.fstat(self._fd).st_size // RECORD_BYTES

    def truncate_to(self, n_records: int) -> int:
        """Cut the log to its first ``n_records``; returns how many records were dropped.

        Raises:
            StateError: the log holds fewer records than a checkpoint counted (it was damaged).
        """
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        if size < n_records * RECORD_BYTES:
            raise StateError(
                self.path,
                f"holds {size // RECORD_BYTES} records but the checkpoint counts "
                f"{n_records}; the audit log was damaged or replaced",
            )
        os.ftruncate(self._fd, n_records * RECORD_BYTES)
        os.fsync(self._fd)
        dropped = self.records - n_records
        self.records = n_records
        return max(0, dropped)

    def append(self, batch_id: int, step: int, run_id: int, digest: int) -> None:
        assert self._fd is not None
        os.write(self._fd, _FMT.format(batch_id, step, run_id, digest).encode("ascii"))
        self.records += 1

    def sync(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_records(path: Path) -> tuple[list[AuditRecord], int]:
    """All complete records, plus the number of trailing bytes of a torn last record (no log: none).

    Raises:
        StateError: the log is not a regular file (a directory, a FIFO) or cannot be read (exit 78).
    """
    if not os.path.lexists(path):
        return [], 0
    try:
        data = read_regular_file(path, None, "audit log")
    except ConfigError as err:
        raise StateError(path, err.reason) from None
    out = []
    for i in range(len(data) // RECORD_BYTES):
        line = data[i * RECORD_BYTES : (i + 1) * RECORD_BYTES].decode("ascii", errors="replace").split()
        try:
            out.append(AuditRecord(int(line[0]), int(line[1]), int(line[2], 16), int(line[3], 16)))
        except (ValueError, IndexError) as err:
            raise StateError(path, f"record {i} is not a valid audit record: {err}") from err
    return out, len(data) % RECORD_BYTES


@dataclass
class AuditResult:
    applied: int = 0  # records in the log
    expected: int = 0  # plan positions 0 .. expected-1
    lost: int = 0  # planned ids never applied
    duplicated: int = 0  # records repeating an id already applied
    out_of_order: int = 0  # records whose id is not greater than the one before
    wrong_content: int = 0  # records whose sample digest differs from the plan's
    content_checked: bool = False
    content_note: str = ""
    consumer_epochs: int = 0  # distinct consumer starts that applied batches
    torn_bytes: int = 0  # a partial last record (cut on the next resume)
    checkpoint_next_batch: int | None = None
    after_checkpoint: int = 0  # records after the newest checkpoint (replayed on resume)
    first_bad: list[str] = field(default_factory=list)
    rank: int = 0  # from run.json: this log's rank in a job of ``world`` (ids are its steps)
    world: int = 1

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.out_of_order or self.wrong_content)


def analyse(
    records: Sequence[AuditRecord], expected_digest: dict[int, int] | None = None, expected_end: int | None = None
) -> AuditResult:
    """Compare records with the plan ``0 .. expected_end-1`` (default: up to the largest id)."""
    ids = [r.batch_id for r in records]
    end = max(expected_end or 0, (max(ids) + 1) if ids else 0)
    res = AuditResult(applied=len(records), expected=end, consumer_epochs=len({r.run_id for r in records}))
    seen: set[int] = set()
    prev = -1
    for i, r in enumerate(records):
        if r.batch_id in seen:
            res.duplicated += 1
            _note(res, f"record {i}: batch {r.batch_id} applied again")
        seen.add(r.batch_id)
        if r.batch_id <= prev:
            res.out_of_order += 1
            _note(res, f"record {i}: batch {r.batch_id} after {prev}")
        prev = r.batch_id
        if expected_digest is not None and expected_digest.get(r.batch_id) != r.digest:
            res.wrong_content += 1
            _note(res, f"record {i}: batch {r.batch_id} samples differ from the plan")
    missing = [b for b in range(end) if b not in seen]
    res.lost = len(missing)
    if missing:
        _note(res, f"lost batch ids (first): {missing[:10]}")
    return res


def _note(res: AuditResult, text: str) -> None:
    if len(res.first_bad) < 10:
        res.first_bad.append(text)


def audit_state_dir(state_dir: str | os.PathLike[str]) -> AuditResult:
    """Audit ``STATE_DIR/audit.log`` against the plan recorded in ``STATE_DIR/run.json``.

    The plan's content is checked when the cache named in run.json is readable and unchanged
    (same fingerprint); otherwise only ids and order are checked, and ``content_note`` says why.
    """
    from melfeed.consumer.resume.checkpoint import latest_cursor  # no TensorFlow: only reads cursor.json

    root = Path(state_dir)
    run = read_run_identity(root)
    records, torn = read_records(root / AUDIT_NAME)
    cursor = latest_cursor(root)
    plan_end = max((r.batch_id for r in records), default=-1) + 1
    digests, note = _planned_digests(root, run, plan_end)
    res = analyse(records, digests, cursor.next_batch if cursor else None)
    res.rank, res.world = run["rank"], run["world"]
    res.torn_bytes = torn
    res.content_checked = digests is not None
    res.content_note = note
    if cursor is not None:
        res.checkpoint_next_batch = cursor.next_batch
        res.after_checkpoint = max(0, len(records) - cursor.audit_records)
    return res


def read_run_identity(root: Path) -> dict[str, Any]:
    """``STATE_DIR/run.json``, with ``rank`` 0 and ``world`` 1 where a run from before ranks has none.

    Raises:
        StateError: no run.json (not a state directory), or one that is not a JSON object (exit 78).
    """
    path = root / RUN_NAME
    if not path.is_file():
        raise StateError(root, f"no {RUN_NAME}: not a melfeed state directory (consumer.state_dir)")
    try:
        run = json.loads(read_regular_file(path, _MAX_RUN_JSON_BYTES, RUN_NAME))
    except ConfigError as err:
        raise StateError(path, err.reason) from None
    except RecursionError:
        raise StateError(path, "unreadable: JSON nested too deeply") from None
    except (OSError, ValueError) as err:
        raise StateError(path, f"unreadable: {err}") from None
    if not isinstance(run, dict):
        raise StateError(path, "not a JSON object")
    run.setdefault("rank", 0)
    run.setdefault("world", 1)
    if not (type(run["rank"]) is int and type(run["world"]) is int and 0 <= run["rank"] < run["world"]):
        raise StateError(path, f"rank {run['rank']!r} of world {run['world']!r} is not a rank of that world")
    return run


def _planned_digests(root: Path, run: dict[str, Any], end: int) -> tuple[dict[int, int] | None, str]:
    from melfeed.consumer.flow.shards import plan_for_rank
    from melfeed.consumer.train.measure_cache import planned_settings
    from melfeed.shared.cache.manifest import load_manifest
    from melfeed.shared.config.loader import config_from_mapping
    from melfeed.shared.errors import PipelineError
    from melfeed.shared.wire.buckets import build_buckets

    try:
        cfg = config_from_mapping(
            {"cache_dir": run["cache_dir"], "seed": run["seed"], "n_mels": run["n_mels"], "buckets": run["buckets"]}
        )
        manifest = load_manifest(run["cache_dir"], cfg.n_mels)
    except (OSError, ValueError, KeyError, TypeError, PipelineError) as err:
        return None, f"plan content not checked: {err}"
    if manifest.fingerprint != run.get("fingerprint"):
        return None, f"plan content not checked: cache {run['cache_dir']} changed since the run (fingerprint)"
    try:
        plan = plan_for_rank(
            build_buckets(
                manifest.frames, manifest.token_counts, cfg.n_mels, planned_settings(root, cfg.buckets), manifest.schema
            ),
            manifest.fingerprint,
            cfg.seed,
            run["rank"],
            run["world"],
            cfg.buckets.partial,
        )
    except PipelineError as err:
        return None, f"plan content not checked: {err}"
    return {b: sample_digest(plan.batch(b).sample_ids) for b in range(end)}, "plan content checked"


def main_audit(args: argparse.Namespace) -> int:
    """Print the audit; exit 0 when nothing is lost, duplicated, out of order or different."""
    state_dir = args.state_dir if isinstance(args.state_dir, str) else args.state_dir[0]
    check_output_file(getattr(args, "output", None), "--output")
    res = audit_state_dir(state_dir)
    if not write_json(args, asdict(res) | {"ok": res.ok}):
        print_result(state_dir, res)
        print(
            "OK: the applied sequence equals the plan"
            if res.ok
            else "FAILED: the applied sequence differs from the plan"
        )
    return 0 if res.ok else 1


def print_result(state_dir: str, res: AuditResult) -> None:
    """The counts of one state directory (a rank's share when ``world`` > 1: its ids are its steps)."""
    ckpt = "none" if res.checkpoint_next_batch is None else f"next batch {res.checkpoint_next_batch}"
    share = f" (rank {res.rank} of {res.world}: its share, ids are its steps)" if res.world > 1 else ""
    print(
        f"audit {state_dir}{share}: {res.applied} batches applied by {res.consumer_epochs} consumer start(s); "
        f"plan 0..{res.expected - 1}; checkpoint: {ckpt}"
    )
    print(
        f"lost {res.lost} | duplicated {res.duplicated} | out of order {res.out_of_order} | "
        f"wrong content {res.wrong_content} ({res.content_note})"
    )
    if res.after_checkpoint or res.torn_bytes:
        print(
            f"note: {res.after_checkpoint} records after the newest checkpoint and {res.torn_bytes} torn bytes"
            " are replaced when the consumer resumes"
        )
    for line in res.first_bad:
        print(f"  {line}")


def write_json(args: argparse.Namespace, doc: dict[str, Any]) -> bool:
    """``-o FILE`` writes the document, ``--json`` prints it instead of the text; True when it was printed.

    A failed write (disk full) is one line naming the file (exit 1); the path itself was checked before the
    audit (``check_output_file``).
    """
    text = json.dumps(doc, indent=2) + "\n"
    if getattr(args, "output", None):
        try:
            write_output(args.output, text, what="--output")  # a refusal: ConfigError, exit 78
        except OSError as err:
            raise StateError(args.output, f"cannot write: {err.strerror or err}", fatal=False) from None
    if getattr(args, "json", False):
        print(text, end="")
        return True
    return False
