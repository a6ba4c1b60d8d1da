"""``melfeed audit STATE_DIR [STATE_DIR ...]``: exactly once over the union of a job's ranks.

Role: each rank of a multi-worker job keeps its own state directory, whose audit log records its
steps (local ids, ``consumer/flow/shards.py``). Given the state directories of a job, this checks
each one against its rank's share of the sharded plan (``audit.audit_state_dir``: lost, duplicated,
out of order, wrong content), then the union against the whole plan: every plan-wide id
``step * world + rank`` below ``world * job_end`` applied exactly once, where ``job_end`` is the step
the furthest rank reached (its checkpoint cursor or its newest record). A rank that stopped short,
or whose directory was not given, counts as lost in the total; two directories of the same rank
count as duplicated. One state directory keeps the single-consumer output (``audit.main_audit``).

Invariants: every directory must name the same plan in ``run.json`` (fingerprint, seed, n_mels,
buckets) and the same world size; otherwise one line naming the directory (exit 78), never a
total over two different plans. Read-only: nothing here writes to a state directory.
Shutdown: nothing to release.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from melfeed.consumer.resume.audit import (
    AUDIT_NAME,
    AuditResult,
    audit_state_dir,
    print_result,
    read_records,
    read_run_identity,
    write_json,
)
from melfeed.consumer.resume.audit import (
    main_audit as main_audit_one,
)
from melfeed.shared.errors import StateError
from melfeed.shared.flag_checks import check_output_file

__all__ = ["JobAudit", "audit_job", "main_audit", "union_counts"]

_SAME_PLAN_KEYS = ("fingerprint", "seed", "n_mels", "buckets", "world")
_MAX_NOTES = 10


@dataclass
class JobAudit:
    """The ranks' own audits and the union's counts (plan-wide ids)."""

    world: int
    ranks: list[tuple[str, AuditResult]]  # (state dir, its audit), in the order given
    job_end: int = 0  # steps every rank should have applied
    expected: int = 0  # plan-wide ids 0 .. expected-1 (world * job_end)
    applied: int = 0
    lost: int = 0
    duplicated: int = 0
    out_of_order: int = 0
    wrong_content: int = 0
    missing_ranks: list[int] = field(default_factory=list)
    first_bad: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.out_of_order or self.wrong_content)


def union_counts(world: int, logs: Sequence[tuple[int, Sequence[int]]], job_end: int) -> tuple[int, int, list[int]]:
    """Lost and duplicated plan-wide ids over the union of ranks' applied ids; pure.

    Args:
        world: ranks in the job.
        logs: ``(rank, applied local ids)`` per state directory.
        job_end: steps every rank should have applied.

    Returns:
        ``(lost, duplicated, first lost plan-wide ids)``: ids below ``world * job_end`` never applied,
        and applications of an id beyond its first (in any directory).
    """
    seen = Counter(step * world + rank for rank, ids in logs for step in ids)
    duplicated = sum(n - 1 for n in seen.values())
    missing = [g for g in range(world * job_end) if g not in seen]
    return len(missing), duplicated, missing[:_MAX_NOTES]


def audit_job(state_dirs: Sequence[str]) -> JobAudit:
    """Audit each state directory against its rank's share, then their union against the plan.

    Raises:
        StateError: a directory that is not a state directory, or that belongs to another plan or
            world size than the first one given (fatal: exit 78).
    """
    first: dict[str, Any] | None = None
    logs: list[tuple[int, list[int]]] = []
    ranks: list[tuple[str, AuditResult]] = []
    for state_dir in state_dirs:
        run = read_run_identity(Path(state_dir))
        if first is None:
            first = run
        for key in _SAME_PLAN_KEYS:
            if run.get(key) != first.get(key):
                raise StateError(
                    state_dir,
                    f"belongs to another job than {state_dirs[0]}: {key}={run.get(key)!r}, not {first.get(key)!r}",
                )
        records, _ = read_records(Path(state_dir) / AUDIT_NAME)
        logs.append((int(run["rank"]), [r.batch_id for r in records]))
        ranks.append((state_dir, audit_state_dir(state_dir)))
    assert first is not None, "argparse requires at least one state directory"
    world = int(first["world"])  # an int 1.. (read_run_identity checked it)
    job = JobAudit(world, ranks, job_end=max(res.expected for _, res in ranks))
    job.expected = world * job.job_end
    job.lost, job.duplicated, lost_ids = union_counts(world, logs, job.job_end)
    job.applied = sum(res.applied for _, res in ranks)
    job.out_of_order = sum(res.out_of_order for _, res in ranks)
    job.wrong_content = sum(res.wrong_content for _, res in ranks)
    job.missing_ranks = sorted(set(range(world)) - {rank for rank, _ in logs})
    if job.missing_ranks:
        job.first_bad.append(f"no state directory given for rank(s) {job.missing_ranks}: their shares count as lost")
    if lost_ids:
        job.first_bad.append(f"lost plan-wide ids (first; id = step * {world} + rank): {lost_ids}")
    return job


def main_audit(args: argparse.Namespace) -> int:
    """One state dir: the single-consumer audit. Several: each rank, then the union; exit 0 only when exact."""
    dirs = [args.state_dir] if isinstance(args.state_dir, str) else list(args.state_dir)
    if len(dirs) == 1:
        return main_audit_one(args)
    check_output_file(getattr(args, "output", None), "--output")  # before the audit, not after it
    job = audit_job(dirs)
    doc = {
        "world": job.world,
        "ranks": [{"state_dir": d, **asdict(r), "ok": r.ok} for d, r in job.ranks],
        "total": {k: v for k, v in asdict(job).items() if k not in ("ranks",)} | {"ok": job.ok},
        "ok": job.ok,
    }
    if not write_json(args, doc):
        _print_job(job)
    return 0 if job.ok else 1


def _print_job(job: JobAudit) -> None:
    for state_dir, res in job.ranks:
        print_result(state_dir, res)
        print(f"rank {res.rank}: " + ("exact" if res.ok else "NOT exact"))
    print(
        f"job of {job.world} ranks, {len(job.ranks)} state dirs: {job.applied} batches applied; plan-wide ids "
        f"0..{job.expected - 1} ({job.job_end} steps x {job.world} ranks)"
    )
    print(
        f"total: lost {job.lost} | duplicated {job.duplicated} | out of order {job.out_of_order} | "
        f"wrong content {job.wrong_content}"
    )
    for line in job.first_bad:
        print(f"  {line}")
    print(
        "OK: every batch of the plan applied exactly once over the ranks, in order"
        if job.ok
        else "FAILED: the ranks' applied batches differ from the plan"
    )
