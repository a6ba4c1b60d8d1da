"""Per-rank defaults: the names that two ranks of one job on the same host must not share.

Role: the one place that turns a rank into names. In a world of 1 nothing changes: the suffix is
empty and the config comes back as it was. In a world of more, rank R's defaults carry ``-rankR``:

    transport.endpoint          ipc://<runtime dir>/melfeed-rankR.sock (unset only); the status socket
                                (``melfeed-rankR.control.sock``), the socket locks and the shared-memory
                                slot files sit beside it, so they follow it
    consumer.control_endpoint   ipc://<runtime dir>/melfeed-rankR-control.sock (unset, and a tcp
                                transport endpoint, whose status socket would be the shared default)
    deploy (units.py)           consumer-rankR.service, producer-rankR@.service, pipeline-rankR.target,
                                /run/melfeed-rankR, /var/lib/melfeed-rankR

Invariants:
    * A value set in the config or on the command line always wins; only unset keys get a default.
    * The consumer and the producers of one rank compute the same names from the same ``TF_CONFIG``
      (both read ``--tf-config FILE`` or the ``TF_CONFIG`` variable), so they meet without
      configuring an endpoint; the slot files are named by the consumer's pid and need no rank.
    * ``--rank R`` (``check_expected_rank``) refuses a ``TF_CONFIG`` whose task is another rank: one
      ``ConfigError`` line (exit 78), so a TF_CONFIG file copied to the wrong host cannot start a
      second rank 0.
Shutdown: nothing to release.
"""

from __future__ import annotations

from collections.abc import Mapping

from melfeed.shared.config import PipelineConfig, resolve_runtime_dir
from melfeed.shared.config.loader import with_overrides
from melfeed.shared.errors import ConfigError
from melfeed.shared.service.lifecycle import prepare_runtime_dir
from melfeed.shared.service.tf_config import WorkerPlace

__all__ = ["check_expected_rank", "rank_suffix", "with_rank_defaults"]


def rank_suffix(place: WorkerPlace) -> str:
    """``""`` for a world of 1 (today's names), else ``"-rank<R>"``."""
    return f"-rank{place.rank}" if place.is_multi_worker else ""


def check_expected_rank(place: WorkerPlace, expected: int | None, flag: str = "--rank") -> None:
    """Refuse ``place`` unless it is rank ``expected`` (``None``: nothing to check).

    Raises:
        ConfigError: ``expected`` is not a rank of the cluster, or the TF_CONFIG's task is another rank.
    """
    if expected is None:
        return
    if not 0 <= expected < place.world:
        where = (
            f"the cluster in {place.source}"
            if place.is_multi_worker
            else "a world of 1 (the TF_CONFIG names no cluster, or there is none)"
        )
        raise ConfigError(
            f"{expected} is not a rank of {where}: ranks are 0..{place.world - 1} (chief first, "
            "then the workers by index)",
            path=(flag,),
        )
    if expected != place.rank:
        raise ConfigError(
            f"{expected}, but {place.source} names task {place.task_type}:{place.task_index}, which "
            f"is rank {place.rank} of {place.world} (is this the TF_CONFIG of another host?)",
            path=(flag,),
        )


def with_rank_defaults(
    cfg: PipelineConfig, place: WorkerPlace, environ: Mapping[str, str], *, create_dir: bool = True
) -> PipelineConfig:
    """``cfg`` with rank ``place.rank``'s default endpoint (and status socket) filled in where unset.

    Args:
        cfg: the effective config (file and flags).
        place: this process's rank and world (``shared/service/tf_config.py``).
        environ: where the runtime directory is read from (``resolve_runtime_dir``).
        create_dir: make the runtime directory (0700) as ``resolve_endpoint`` would; ``False`` for
            commands that only connect (``status``).

    Raises:
        ConfigError: the runtime directory cannot be made or is not private (``prepare_runtime_dir``).
    """
    if not place.is_multi_worker:
        return cfg
    suffix = rank_suffix(place)
    runtime = resolve_runtime_dir(environ)
    endpoint = cfg.transport.endpoint
    overrides: dict[str, str] = {}
    if endpoint is None:
        overrides["transport.endpoint"] = f"ipc://{runtime / f'melfeed{suffix}.sock'}"
    elif not endpoint.startswith("ipc://") and cfg.consumer.control_endpoint is None:
        overrides["consumer.control_endpoint"] = f"ipc://{runtime / f'melfeed{suffix}-control.sock'}"
    if overrides and create_dir:
        prepare_runtime_dir(runtime)
    return with_overrides(cfg, overrides)
