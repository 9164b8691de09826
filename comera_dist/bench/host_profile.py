"""Where a step's host time goes, by Python function (``cProfile``), beside ``six_encoder.top_ops``'s aten ops.

An op profile shows which kernels a host-bound step launches. It does not show the Python between them:
DeepSpeed's bookkeeping, hooks, the session's objective. ``bench trainer-rate`` records both for the bare
step and the session step, so a GPU run can say which functions make up the gap between them. Two views of
one profile: by own time (which functions burn the host) and by cumulative time (which phase: DeepSpeed's
``forward``, ``backward`` and ``step``, the session's reads). cProfile slows every Python call it records, so
compare rows within one profile, not against a timed step.
"""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable
from pathlib import Path
from typing import Any

SELF, CUMULATIVE = 2, 3  # pstats rows: (primitive calls, calls, tottime, cumtime, callers)


def host_profile(fn: Callable[[], Any], runs: int = 5, n: int = 25, n_cumulative: int = 60, *,
                 timer: Callable[[], float] | None = None) -> dict[str, Any]:
    """Run ``fn()`` ``runs`` times under one ``cProfile``; its top ``n`` functions by own time and top
    ``n_cumulative`` by cumulative time (more: the wrappers around each phase take the first rows).

    Returns ``{"runs": runs, "by_self": rows, "by_cumulative": rows}``. Each row: ``function``
    (``path:line(name)``, the path from the package root: ``deepspeed/...``, ``comera_dist/...``,
    ``torch/...``; C functions as cProfile names them, e.g. ``<built-in method torch.bmm>``), ``calls``,
    ``self_s`` (time in the function itself) and ``cum_s`` (with its callees), both per run, and ``share``
    (of the profile's total own time). Several runs average out a step's one-off work (a lazy allocation,
    a cache fill) that one profiled run would show as a hot spot. ``timer``: cProfile's clock, in seconds
    (default its own wall clock).
    """
    if runs < 1:
        raise ValueError(f"host_profile: runs must be >= 1, got {runs}")
    profiler = cProfile.Profile(timer) if timer else cProfile.Profile()
    profiler.enable()
    try:
        for _ in range(runs):
            fn()
    finally:
        profiler.disable()
    return profile_rows(profiler, runs, n, n_cumulative)


def profile_rows(profiler: cProfile.Profile, runs: int, n: int = 25, n_cumulative: int = 60, *,
                 roots: bool = False) -> dict[str, Any]:
    """``host_profile``'s result from a ``profiler`` that recorded ``runs`` repetitions some other way (e.g.
    enabled and disabled around whole iterations of the trainer's loop). ``roots``: also ``root_rows``, the
    calls made from frames that began before the profiler did, with their cumulative time (for a loop profiled
    from inside it: the loop's own calls, its phases, however small beside the step's nested calls)."""
    stats = pstats.Stats(profiler).stats
    result = {"runs": runs, "by_self": _top(stats, SELF, n, runs),
              "by_cumulative": _top(stats, CUMULATIVE, n_cumulative, runs)}
    if roots:
        result["root_rows"] = _roots(stats, runs)
    return result


def _roots(stats: dict, runs: int) -> list[dict[str, Any]]:
    """Each function's calls with no profiled caller (its calls minus those its recorded callers made), by the
    cumulative time of those calls.

    pstats keeps ``stats[f] = (primitive calls, calls, own time, cumulative time, callers)`` and
    ``callers[g] = (calls, primitive calls, own time, cumulative time)`` of g's calls of f. A recursive f's
    cumulative time counts its outermost calls only, which hold the calls it made of itself: its own edge's
    cumulative time is not subtracted (mutual recursion through another function is not untangled)."""
    rows = []
    for key, (_, calls, self_s, cum_s, callers) in stats.items():
        by_callers = sum(c[0] for c in callers.values())
        if calls > by_callers:
            rows.append({"function": _name(key), "calls": (calls - by_callers) / runs,
                         "self_s": (self_s - sum(c[2] for c in callers.values())) / runs,
                         "cum_s": (cum_s - sum(c[3] for g, c in callers.items() if g != key)) / runs})
    return sorted(rows, key=lambda r: r["cum_s"], reverse=True)


def _top(stats: dict, column: int, n: int, runs: int) -> list[dict[str, Any]]:
    total = sum(row[SELF] for row in stats.values()) or 1.0
    rows = sorted(stats.items(), key=lambda kv: kv[1][column], reverse=True)[:n]
    return [{"function": _name(key), "calls": calls / runs, "self_s": self_s / runs, "cum_s": cum_s / runs,
             "share": self_s / total} for key, (_, calls, self_s, cum_s, _) in rows]


def _name(key: tuple[str, int, str]) -> str:
    path, line, name = key
    if path == "~" and line == 0:  # a C function
        return name
    parts = Path(path).parts
    for root in ("site-packages", "comera_dist"):
        if root in parts:
            start = parts.index(root) + (root == "site-packages")
            path = "/".join(parts[start:])
            break
    return f"{path}:{line}({name})"
