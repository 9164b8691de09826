"""History: the values the run logged, kept in bounded memory on rank 0 for the final report.

A series keeps every value until it holds ``max_points``; then every other point is dropped and from
then on only every second value is kept, and so on (a stride that doubles), so a series always holds
at most ``max_points`` evenly spaced points plus its latest value, whatever the run's length. Its
first and latest values and its finite minimum and maximum (with their steps) are exact. Rank
snapshots thin the same way. Unbounded, the trainer's history grew about 1.2 KB per step on rank 0
(tracemalloc; most of the soak run's RSS drift), 1.2 GB over a million steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")

MAX_POINTS = 10_000
"""Default points kept per scalar series (the plots' resolution)."""
MAX_RANK_SNAPSHOTS = 2_000
"""Default rank snapshots kept (the heatmap's columns); a snapshot holds every layer's ranks."""


@dataclass(slots=True)
class _Thinned(Generic[T]):
    """Evenly spaced ``(step, item)`` points of a stream, plus its latest point; one point per step (a value
    logged again at the latest point's step is dropped: the series and the extremes keep the first)."""

    max_points: int
    points: list[tuple[int, T]] = field(default_factory=list)
    stride: int = 1
    seen: int = 0
    tail: bool = False
    """Whether ``points[-1]`` is the latest point held only until the next one (not a sampled point)."""

    def add(self, step: int, item: T) -> bool:
        """Whether ``item`` was taken (False: its step is the latest point's already)."""
        if self.points and self.points[-1][0] == step:  # the same step again (a resumed job's starting values):
            return False                                # one point per step, the first value
        if self.tail:
            self.points.pop()
        sampled = self.seen % self.stride == 0
        self.seen += 1
        self.points.append((step, item))
        self.tail = not sampled
        if sampled and len(self.points) > self.max_points:
            del self.points[1::2]  # keeps the points at seen-counts 0, 2*stride, 4*stride, ...
            self.stride *= 2
            if self.points[-1][0] != step:  # the latest went with the odd ones: hold it as the tail
                self.points.append((step, item))
                self.tail = True
        return True


@dataclass(slots=True)
class _Extremes:
    """The finite minimum and maximum of a series and their steps."""

    low: tuple[int, float] | None = None
    high: tuple[int, float] | None = None

    def add(self, step: int, value: float) -> None:
        if not math.isfinite(value):
            return
        if self.low is None or value < self.low[1]:
            self.low = (step, value)
        if self.high is None or value > self.high[1]:
            self.high = (step, value)


@dataclass(slots=True)
class History:
    """Logged scalars, rank snapshots and checkpoint outcomes, in logging order, in bounded memory."""

    max_points: int = MAX_POINTS
    max_rank_snapshots: int = MAX_RANK_SNAPSHOTS
    checkpoints: list[tuple[int, bool, float]] = field(default_factory=list)
    """``[(step, ok, unix time), ...]`` from ``Metrics.checkpoint_saved`` (one per save: not thinned)."""
    _scalars: dict[str, _Thinned[float]] = field(default_factory=dict, init=False)
    _extremes: dict[str, _Extremes] = field(default_factory=dict, init=False)
    _ranks: _Thinned[dict[str, list[int]]] = field(init=False)

    def __post_init__(self) -> None:
        for name in ("max_points", "max_rank_snapshots"):
            if getattr(self, name) < 2:
                raise ValueError(f"History.{name} must be >= 2, got {getattr(self, name)}")
        self._ranks = _Thinned(self.max_rank_snapshots)

    @property
    def scalars(self) -> dict[str, list[tuple[int, float]]]:
        """``key -> [(step, value), ...]`` for every key ever logged: every value while a series is short,
        then evenly spaced ones; the first and the latest always. Do not modify."""
        return {key: series.points for key, series in self._scalars.items()}

    @property
    def ranks(self) -> list[tuple[int, dict[str, list[int]]]]:
        """``[(step, {layer: [rank per interior bond]}), ...]`` from ``Metrics.log_ranks``, thinned like a
        series (the first and the latest snapshot always). Do not modify."""
        return self._ranks.points

    def add_scalars(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            if key not in self._scalars:
                self._scalars[key], self._extremes[key] = _Thinned(self.max_points), _Extremes()
            if self._scalars[key].add(step, value):  # not when this step holds a value already: the first stands
                self._extremes[key].add(step, value)

    def add_ranks(self, snapshot: dict[str, list[int]], step: int) -> None:
        self._ranks.add(step, snapshot)

    def last(self, key: str) -> float | None:
        series = self._scalars.get(key)
        return series.points[-1][1] if series else None

    def best(self, key: str, *, lowest: bool = True) -> tuple[int, float] | None:
        """The (step, value) with the lowest (or highest) finite value of ``key`` ever logged."""
        extremes = self._extremes.get(key)
        if extremes is None:
            return None
        return extremes.low if lowest else extremes.high

    # ---- persistence: a resumed job's report covers the whole run -------------------------------
    def state(self) -> dict[str, Any]:
        """Plain JSON-able data of everything held (``from_state`` rebuilds it exactly)."""
        def thinned(t: _Thinned) -> dict[str, Any]:
            return {"points": t.points, "stride": t.stride, "seen": t.seen, "tail": t.tail}

        return {"max_points": self.max_points, "max_rank_snapshots": self.max_rank_snapshots,
                "checkpoints": self.checkpoints, "ranks": thinned(self._ranks),
                "scalars": {k: thinned(t) for k, t in self._scalars.items()},
                "extremes": {k: [e.low, e.high] for k, e in self._extremes.items()}}

    @classmethod
    def from_state(cls, state: dict[str, Any], *, upto: int | None = None) -> History:
        """The history ``state()`` described; ``upto``: without what was logged after that step (a resume from
        an older checkpoint than the state's last one). Extremes are then those of the points kept."""
        h = cls(max_points=state["max_points"], max_rank_snapshots=state["max_rank_snapshots"])
        keep = (lambda step: True) if upto is None else (lambda step: step <= upto)

        def thinned(data: dict[str, Any], max_points: int) -> _Thinned:
            points = [(int(s), v) for s, v in data["points"] if keep(s)]
            whole = len(points) == len(data["points"])
            return _Thinned(max_points, points, data["stride"], data["seen"] if whole else len(points),
                            data["tail"] and whole)

        h.checkpoints = [(int(s), bool(ok), float(t)) for s, ok, t in state["checkpoints"] if keep(s)]
        h._ranks = thinned(state["ranks"], h.max_rank_snapshots)
        for key, data in state["scalars"].items():
            series = thinned(data, h.max_points)
            if not series.points:  # first logged after ``upto``: not part of this run (an empty one breaks the report)
                continue
            low, high = state["extremes"][key]
            extremes = _Extremes(tuple(low) if low else None, tuple(high) if high else None)
            if len(series.points) != len(data["points"]):  # cut: the extremes of what is left
                extremes = _Extremes()
                for step, value in series.points:
                    extremes.add(step, value)
            h._scalars[key], h._extremes[key] = series, extremes
        return h

