"""Where a step's host time goes, by Python function (``cProfile``), beside ``six_encoder.top_ops``'s aten ops.

An op profile shows which kernels a host-bound step launches. It does not show the Python between them:
DeepSpeed's bookkeeping, hooks, the session's objective. ``bench trainer-rate`` records both for the bare
step and the session step, so a GPU run can say which functions make up the gap between them. cProfile
slows every Python call it records, so compare rows within one profile, not against a timed step.
"""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable
from pathlib import Path
from typing import Any


def top_functions(fn: Callable[[], Any], n: int = 25) -> list[dict[str, Any]]:
    """Run ``fn()`` once under ``cProfile``; the ``n`` functions with the most own (``tottime``) time.

    Each row: ``function`` (``path:line(name)``, the path from the package root: ``deepspeed/...``,
    ``comera_dist/...``, ``torch/...``; C functions as cProfile names them, e.g. ``{built-in method
    torch.bmm}``), ``calls``, ``self_s`` (time in the function itself), ``cum_s`` (with its callees) and
    ``share`` (of the profile's total own time).
    """
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        fn()
    finally:
        profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, tottime, cumtime, callers)}
    total = sum(row[2] for row in stats.values()) or 1.0
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:n]
    return [{"function": _name(key), "calls": calls, "self_s": self_s, "cum_s": cum_s, "share": self_s / total}
            for key, (_, calls, self_s, cum_s, _) in rows]


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
