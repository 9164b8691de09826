"""History: every value the run logged, kept in memory on rank 0 for the final report."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(slots=True)
class History:
    """Logged scalars, rank snapshots and checkpoint outcomes, in logging order."""

    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """``key -> [(step, value), ...]`` for every key ever logged (standard or not)."""

    ranks: list[tuple[int, dict[str, list[int]]]] = field(default_factory=list)
    """``[(step, {layer: [rank per interior bond]}), ...]`` from ``Metrics.log_ranks``."""

    checkpoints: list[tuple[int, bool, float]] = field(default_factory=list)
    """``[(step, ok, unix time), ...]`` from ``Metrics.checkpoint_saved``."""

    def add_scalars(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.scalars.setdefault(key, []).append((step, value))

    def last(self, key: str) -> float | None:
        series = self.scalars.get(key)
        return series[-1][1] if series else None

    def best(self, key: str, *, lowest: bool = True) -> tuple[int, float] | None:
        """The (step, value) with the lowest (or highest) finite value of ``key``."""
        finite = [(s, v) for s, v in self.scalars.get(key, []) if math.isfinite(v)]
        if not finite:
            return None
        return min(finite, key=lambda sv: sv[1]) if lowest else max(finite, key=lambda sv: sv[1])
