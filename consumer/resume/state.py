"""One consumer's state directory: exclusive lock, run identity, audit log and checkpoints.

```python
state = RunState.open(cfg, manifest.fingerprint)      # lock, check run.json, resume cursor
consumer = Consumer(cfg, start_batch=state.next_batch)
state.restore_into(items)                             # after warm-up: the checkpointed variables
for batch in consumer.batches(stop):
    step(batch)
    state.record(batch.batch_id, batch.sample_ids, consumer._run_id)
    if state.due():
        state.checkpoint(items, consumer._run_id)
state.checkpoint(items, consumer._run_id)               # on stop and at the end
state.close()
```
Invariants:
    * One consumer per state directory (``flock`` on ``.lock``; the kernel drops it on SIGKILL).
    * ``run.json`` fixes what the plan depends on (fingerprint, seed, n_mels, buckets with
      ``buckets.partial``, and the rank and world size of a multi-worker job); a config that would
      change the plan is refused instead of silently mixing two plans in one lineage. A ``run.json``
      without ``rank`` and ``world`` reads as rank 0 of 1; one without ``buckets.partial`` means
      "pad".
    * Opening truncates the audit log to the newest checkpoint's record count, so the log always
      describes the lineage of the variables that will be trained on.
    * A rank of a multi-worker job resumes from the step the ranks agreed on (``committed_steps``, then
      ``resume_at``; consumer/job/agree.py), which may be older than its own newest checkpoint: the
      cursor, the audit log (truncated to that checkpoint's record count) and the variables all come
      from that one checkpoint, and the newer checkpoints of this rank are removed (a lineage the job
      abandoned: left on disk, a later agreement could pick one whose peers trained on).
    * Everything created here is 0640 / 0750 or stricter whatever the umask (``filemode``): only the
      service user and group can read the variables or the data order.
    * A periodic checkpoint that cannot be written (disk full, too many open files, EIO) is one
      WARNING naming the path and errno, counted in ``checkpoint_failures``, and tried again one
      interval later; training goes on. Nothing of a failed write is committed: the newest checkpoint
      and its cursor stay as they were, so the cursor never gets ahead of the variables. The final
      checkpoint (stop, end of plan) failing raises ``StateError``: one line, exit 1.
      Which call is periodic: ``checkpoint(final=False)``, or a call right after ``due()`` said yes
      at the same record count (the loop's ``if state.due(): state.checkpoint(...)``).
Shutdown: ``close()`` is idempotent and releases the lock.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from melfeed.consumer.resume.audit import AUDIT_NAME, RUN_NAME, AuditLog, sample_digest
from melfeed.consumer.resume.checkpoint import CheckpointStore, Cursor, latest_checkpoint, list_checkpoints, read_cursor
from melfeed.consumer.resume.filemode import STATE_FILE_MODE, make_private_dir, write_private
from melfeed.shared.config import PipelineConfig
from melfeed.shared.config.loader import config_to_mapping
from melfeed.shared.errors import StateError
from melfeed.shared.flag_checks import resolve_path
from melfeed.shared.wire.outliers import OUTLIERS_NAME

__all__ = ["RunState"]

log = logging.getLogger(__name__)

_PLAN_KEYS = ("fingerprint", "seed", "n_mels", "buckets")
_RANK_DEFAULTS = {"rank": 0, "world": 1}  # a run.json from before ranks: one consumer, the whole plan
# buckets keys newer than some run.json files: what those runs used. Such a run recorded an int
# num_buckets (the 1-D plan), under which max_shapes and the cost weights change nothing; a config
# that leaves num_buckets unset (the 2-D plan) differs in num_buckets and is refused.
_BUCKET_KEYS_ADDED = {
    "partial": "pad",
    "max_shapes": 8,
    "token_cost": 1.0,
    "attention_cost": 0.0,
    "max_frames_per_token": None,
    "min_frames_per_token": None,
    "max_batch_size": 256,
    "rows": None,
    "cost_tolerance": 0.0,
    "cost": "formula",
}


class RunState:
    def __init__(self, root: Path, lock_fd: int, identity: dict[str, Any], every_steps: int, keep: int) -> None:
        self.root = root
        self._lock_fd: int | None = lock_fd
        self._identity = identity
        self._every = every_steps
        self._store = CheckpointStore(root, keep)
        found = latest_checkpoint(root)
        self._resume_path = found[0] if found else None
        cursor = found[1] if found else None
        if cursor is not None and (cursor.fingerprint, cursor.seed) != (identity["fingerprint"], identity["seed"]):
            raise StateError(self._resume_path, "checkpoint belongs to another dataset or seed")
        self.next_batch = cursor.next_batch if cursor else 0
        self._audit = AuditLog(root / AUDIT_NAME)
        dropped = self._audit.truncate_to(cursor.audit_records if cursor else 0)
        self._saved_records = self._audit.records
        self._failed_records = -1  # record count of the last failed periodic try
        self._due_records = -1  # record count ``due()`` last said yes at
        self.checkpoint_failures = 0  # periodic checkpoints that could not be written
        where = f"checkpoint {self._resume_path.name}" if self._resume_path else "no checkpoint: from the start"
        log.info(
            "state %s: resuming at batch %d (%s); %d audit records after it dropped",
            root,
            self.next_batch,
            where,
            dropped,
        )

    @classmethod
    def open(cls, cfg: PipelineConfig, fingerprint: str, *, rank: int = 0, world: int = 1) -> RunState | None:
        """The state of ``cfg.consumer.state_dir``, or ``None`` when no state directory is set.

        ``rank`` of ``world``: this consumer's place in a multi-worker job (its share of the plan).

        Raises:
            StateError: another consumer holds the directory, it cannot be created, or it holds
                a run whose plan differs from ``cfg`` or whose rank or world differs (fatal: exit 78).
        """
        if cfg.consumer.state_dir is None:
            log.warning("no consumer.state_dir: no checkpoints or audit log; a restart starts at batch 0")
            return None
        root = resolve_path(cfg.consumer.state_dir, ("consumer", "state_dir"))
        try:
            make_private_dir(root)
            lock_fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, STATE_FILE_MODE)
        except OSError as err:
            raise StateError(root, f"cannot use as state directory: {err.strerror}") from err
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(lock_fd, 32, 0).decode(errors="replace").strip()
            os.close(lock_fd)
            raise StateError(root, f"in use by another consumer (pid {holder or '?'})") from None
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
        try:
            identity = _check_identity(root, cfg, fingerprint, rank, world)
            return cls(root, lock_fd, identity, cfg.consumer.checkpoint_every_steps, cfg.consumer.keep_checkpoints)
        except BaseException:
            os.close(lock_fd)
            raise

    def committed_steps(self) -> list[int]:
        """The steps (next batch ids) of this directory's complete checkpoints, oldest first."""
        return [int(path.name.rsplit("-", 1)[1]) for path in list_checkpoints(self.root)]

    def resume_at(self, step: int | None) -> None:
        """Resume from the checkpoint of ``step`` (None: from the start), as the job's ranks agreed.

        The cursor and the audit log follow that checkpoint; this rank's checkpoints newer than it are
        removed (the job abandoned their lineage).

        Raises:
            StateError: this directory has no readable checkpoint of ``step`` (exit 78).
        """
        if step is None:
            if self.committed_steps():
                raise StateError(
                    self.root,
                    "the job starts from scratch but this rank has checkpoints: every rank "
                    "must start with an empty state directory, or all with theirs",
                )
            return
        path = self._store.path_of(step)
        try:
            cursor = read_cursor(path)
        except (OSError, ValueError, TypeError) as err:
            raise StateError(
                path,
                f"the job resumes from step {step}, but this rank cannot read that checkpoint "
                f"({err}); restore it or start every rank with new state directories",
            ) from None
        if (cursor.fingerprint, cursor.seed) != (self._identity["fingerprint"], self._identity["seed"]):
            raise StateError(path, "checkpoint belongs to another dataset or seed")
        for newer in [p for p in list_checkpoints(self.root) if int(p.name.rsplit("-", 1)[1]) > step]:
            log.warning(
                "removing checkpoint %s: newer than the job's common step %d (a lineage the job abandoned)",
                newer.name,
                step,
            )
            self._store.remove(newer)
        dropped = self._audit.truncate_to(cursor.audit_records)
        self._resume_path, self.next_batch = path, cursor.next_batch
        self._saved_records = self._audit.records
        log.info(
            "state %s: the job resumes at step %d (checkpoint %s); %d more audit records dropped",
            self.root,
            self.next_batch,
            path.name,
            dropped,
        )

    @property
    def resumed(self) -> bool:
        return self._resume_path is not None

    def restore_into(self, items: dict[str, object]) -> None:
        """Load the resume checkpoint's variables (no-op when starting from scratch)."""
        if self._resume_path is not None:
            CheckpointStore.restore(self._resume_path, items)
            log.info("restored variables from %s", self._resume_path.name)

    def write_outliers(self, rows: Sequence[tuple[str, int, int, str]]) -> Path:
        """Replace ``outliers.tsv``: one line per utterance the plan leaves out (id, frames, tokens, reason)."""
        path = self.root / OUTLIERS_NAME
        text = "id\tframes\ttokens\treason\n" + "".join(f"{u}\t{f}\t{t}\t{r}\n" for u, f, t, r in rows)
        tmp = path.with_suffix(".tmp")
        write_private(tmp, text.encode("utf-8"))
        os.replace(tmp, path)
        return path

    def record(self, batch_id: int, sample_ids: Sequence[int], run_id: int) -> None:
        """Batch ``batch_id`` was applied (its step finished) by the consumer start ``run_id``."""
        self._audit.append(batch_id, self._audit.records + 1, run_id, sample_digest(sample_ids))
        self.next_batch = batch_id + 1

    def due(self, pending: int = 0) -> bool:
        """An interval of steps passed since the last checkpoint (or the last failed try), now or once
        ``pending`` more batches are recorded (the stager drains its in-flight steps before one)."""
        is_due = self._audit.records + pending - max(self._saved_records, self._failed_records) >= self._every
        if is_due and pending == 0:
            self._due_records = self._audit.records
        return is_due

    def checkpoint(self, items: dict[str, object], run_id: int, *, final: bool | None = None) -> None:
        """Commit variables + cursor if anything was applied since the last one.

        Args:
            final: False for a periodic checkpoint (a failure is logged, counted and retried an
                interval later), True for the last one; None: periodic when ``due()`` just said so.

        Raises:
            StateError: the final checkpoint could not be written (the previous one is intact).
        """
        periodic = (not final) if final is not None else self._due_records == self._audit.records
        self._due_records = -1
        if self._audit.records == self._saved_records:
            return
        try:
            self._commit(items, run_id)
        except StateError as err:
            if not periodic:
                raise
            self.checkpoint_failures += 1
            self._failed_records = self._audit.records
            log.warning(
                "periodic checkpoint failed: %s (%s); training goes on, the next try is in %d steps, %d failed so far",
                err.path,
                _errno_name(err),
                self._every,
                self.checkpoint_failures,
            )

    def _commit(self, items: dict[str, object], run_id: int) -> None:
        try:
            self._audit.sync()
        except OSError as err:
            raise StateError(self._audit.path, f"fsync failed: {err.strerror}", fatal=False) from err
        cursor = Cursor(
            self.next_batch,
            self._audit.records,
            self._identity["seed"],
            self._identity["fingerprint"],
            run_id,
            time.time(),
        )
        self._resume_path = self._store.save(cursor, items)
        self._saved_records = self._audit.records

    def close(self) -> None:
        self._audit.close()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _errno_name(err: StateError) -> str:
    """``errno ENOSPC``-style name of what made the write fail (TensorFlow's errors carry no errno)."""
    cause = err.__cause__
    code = getattr(cause, "errno", None)
    if isinstance(code, int):
        return f"errno {errno.errorcode.get(code, code)}"
    return f"{type(cause).__name__}: {str(cause).splitlines()[0][:200]}" if cause is not None else err.reason


def _differences(old: Any, new: dict[str, Any]) -> tuple[Any, Any]:
    """Only the ``buckets`` keys that differ, so the refusal names them (whole mappings otherwise)."""
    if not isinstance(old, dict):
        return old, new
    keys = sorted(k for k in {*old, *new} if old.get(k) != new.get(k))
    return {k: old.get(k) for k in keys}, {k: new.get(k) for k in keys}


def _check_identity(root: Path, cfg: PipelineConfig, fingerprint: str, rank: int, world: int) -> dict[str, Any]:
    """Write ``run.json`` on first use; afterwards refuse a config that changes the plan, or another rank."""
    mapping = config_to_mapping(cfg)
    identity = {
        "fingerprint": fingerprint,
        "seed": cfg.seed,
        "n_mels": cfg.n_mels,
        "buckets": mapping["buckets"],
        "cache_dir": str(Path(cfg.cache_dir).resolve()) if cfg.cache_dir else None,
        "rank": rank,
        "world": world,
    }
    path = root / RUN_NAME
    if path.exists():
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise StateError(path, f"unreadable: {err}") from err
        if isinstance(old.get("buckets"), dict):
            old["buckets"] = {**_BUCKET_KEYS_ADDED, **old["buckets"]}
        for key in _PLAN_KEYS:
            if old.get(key) != identity[key]:
                was, now = (
                    _differences(old.get(key), identity[key]) if key == "buckets" else (old.get(key), identity[key])
                )
                raise StateError(
                    path,
                    f"this state belongs to a run with {key}={was!r}, the config has "
                    f"{now!r}; use a new consumer.state_dir or the original config",
                )
        old_place = (old.get("rank", _RANK_DEFAULTS["rank"]), old.get("world", _RANK_DEFAULTS["world"]))
        if old_place != (rank, world):
            given = "from TF_CONFIG or --tf-config" if world > 1 else "no TF_CONFIG cluster: a single consumer"
            raise StateError(
                path,
                f"this state belongs to rank {old_place[0]} of {old_place[1]}, this consumer is "
                f"rank {rank} of {world} ({given}); give each rank its own consumer.state_dir "
                "and keep the world size of the job",
            )
        if old.get("cache_dir") != identity["cache_dir"]:
            log.info("cache moved from %s to %s (same fingerprint)", old.get("cache_dir"), identity["cache_dir"])
    tmp = path.with_suffix(".tmp")
    write_private(tmp, (json.dumps(identity, indent=1) + "\n").encode("utf-8"))
    os.replace(tmp, path)
    return identity
