"""The shapes a producer plans with the cost weights a consumer gave it (``buckets.cost: measured``).

Role: under ``cost: measured`` the 2-D planner's weights are the consumer's to fit, so a producer has no shapes at
start. Each new consumer epoch's WELCOME gives the weights with the consumer's shapes; ``CostPlanner`` plans this
producer's own shapes with those weights over its own manifest (``build_buckets`` with ``with_costs``), and the
session (``producer/session.py``) joins only if they are the consumer's: a producer never builds a plan the consumer
did not make. The rows are the WELCOME's when the config learns them (``batch_size: auto`` without ``rows``, each at
most ``max_batch_size``), else the config's own.
Invariant: pure and deterministic (no I/O, clock or socket); the last plan is kept, so a consumer restarted with the
same weights and rows costs no second planning. Shutdown: nothing to release.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from melfeed.shared.config import BucketConfig
from melfeed.shared.errors import ConfigError
from melfeed.shared.wire.buckets import Bucket, apply_rows, build_buckets, learns_rows, one_row_settings, with_costs
from melfeed.shared.wire.schema import ExtraSchema

__all__ = ["CostPlanner"]


class CostPlanner:
    """Plans the manifest's shapes with given weights, as the consumer planned its own.

    Args:
        frames, token_counts: [num_utterances] lengths from the manifest (manifest order).
        n_mels: mel channels per frame.
        cfg: this producer's bucket settings (``cost`` is replaced by the weights given).
        schema: the manifest's extras, or None.
        mel_dtype: ``transport.mel_dtype``.
    """

    def __init__(
        self,
        frames: npt.NDArray[np.integer],
        token_counts: npt.NDArray[np.integer],
        n_mels: int,
        cfg: BucketConfig,
        schema: ExtraSchema | None = None,
        *,
        mel_dtype: str = "float32",
    ) -> None:
        self._frames, self._tokens = frames, token_counts
        self._n_mels, self._cfg, self._schema, self._mel_dtype = n_mels, cfg, schema, mel_dtype
        self._last: tuple[tuple[float, float, tuple[int, ...] | None], tuple[Bucket, ...]] | None = None

    def __call__(self, costs: tuple[float, float], rows: list[int]) -> tuple[Bucket, ...]:
        """This producer's shapes planned with ``costs`` (token_cost, attention_cost), in index order.

        Args:
            costs: the WELCOME's weights.
            rows: the row count of each of the consumer's shapes (index order): used only when this producer's
                config learns its rows; a plan of another shape count keeps one row per shape (so it cannot match).

        Raises:
            ConfigError: rows above ``buckets.max_batch_size``, or settings that leave every utterance out or list
                ``buckets.rows`` for another shape count with these weights.
        """
        learns = learns_rows(self._cfg)
        key = (costs[0], costs[1], tuple(rows) if learns else None)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        cfg = with_costs(self._cfg, costs[0], costs[1])
        if learns and rows and max(rows) > cfg.max_batch_size:
            raise ConfigError(
                f"is below the consumer's {max(rows)} rows (set it as the consumer's)",
                path=("buckets", "max_batch_size"),
                got=cfg.max_batch_size,
            )
        planned = build_buckets(
            self._frames,
            self._tokens,
            self._n_mels,
            one_row_settings(cfg) if learns else cfg,
            self._schema,
            mel_dtype=self._mel_dtype,
        ).buckets
        if learns and len(rows) == len(planned):
            planned = apply_rows(planned, rows)
        self._last = (key, planned)
        return planned
