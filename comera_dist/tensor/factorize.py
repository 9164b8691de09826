"""Factorization of layer dimensions into TT/TTM modes, and the capped TT rank profile."""

from __future__ import annotations

import math
from functools import lru_cache


def factorize(n: int, d: int) -> list[int]:
    """Balanced exact factorization of ``n`` into ``d`` factors, in descending order.

    The largest factor is made as small as possible, then the second largest, and so on
    (deterministic). ``factorize(768, 3) == [12, 8, 8]``, ``factorize(3072, 3) == [16, 16, 12]``.
    A prime ``n`` gives ``[n, 1, ...]``: pass explicit modes or pad (see ``factorize_at_least``).
    """
    _check_int("n", n, 1)
    _check_int("d", d, 1)
    return list(_balanced(n, d, n))


def factorize_at_least(n: int, d: int, max_pad: float = 0.25) -> list[int]:
    """``d`` balanced factors whose product is at least ``n`` (TTM vocabulary modes).

    Tries ``n, n+1, ...`` up to ``n * (1 + max_pad)`` and keeps the candidate with the smallest
    largest factor (ties: the smallest product), so padding rows are few and the modes stay small.
    Falls back to ``ceil(n ** (1/d))``-sized factors when no candidate is balanced enough.
    """
    _check_int("n", n, 1)
    _check_int("d", d, 1)
    if max_pad < 0:
        raise ValueError(f"max_pad must be >= 0, got {max_pad}")
    base = math.ceil(round(n ** (1.0 / d), 9))
    best = [base] * d  # always valid: base**d >= n
    best_key = (base, base**d)
    for m in range(n, int(n * (1 + max_pad)) + 1):
        f = _balanced(m, d, best_key[0])  # only candidates whose largest factor can compete
        if f is not None and (f[0], m) < best_key:
            best, best_key = list(f), (f[0], m)
    return sorted(best, reverse=True)


def tt_ranks(modes: list[int], max_rank: int) -> list[int]:
    """Rank profile ``[1, r_1, ..., r_{D-1}, 1]`` with ``r_k = min(max_rank, prod(modes[:k]), prod(modes[k:]))``.

    For TTM the modes are ``m_k * n_k``. The caps are the largest ranks a TT of these modes can
    use; they make the paper's sizes (section 6 of the method doc) come out exactly.
    """
    if not modes:
        raise ValueError("modes must be a non-empty list of positive ints, got []")
    for i, m in enumerate(modes):
        _check_int(f"modes[{i}]", m, 1)
    _check_int("max_rank", max_rank, 1)
    ranks = [1]
    for k in range(1, len(modes)):
        ranks.append(min(max_rank, math.prod(modes[:k]), math.prod(modes[k:])))
    return ranks + [1]


def check_modes(name: str, modes: list[int], dim: int, *, at_least: bool = False) -> list[int]:
    """Validate explicit ``modes`` for a dimension ``dim``; raises ``ValueError`` naming ``name``."""
    if isinstance(modes, int) or not modes:
        raise ValueError(f"{name} must be a non-empty list of positive ints, got {modes!r}")
    modes = list(modes)
    for i, m in enumerate(modes):
        _check_int(f"{name}[{i}]", m, 1)
    p = math.prod(modes)
    if at_least and p < dim:
        raise ValueError(f"{name}={modes} has product {p} < {dim}: the row modes must cover every row")
    if not at_least and p != dim:
        raise ValueError(f"{name}={modes} has product {p}, which differs from the dimension {dim}")
    return modes


def check_ranks(name: str, ranks: list[int], num_cores: int, caps: list[int] | None = None) -> list[int]:
    """Validate a full rank profile (length ``num_cores + 1``, ends 1, every rank >= 1)."""
    if isinstance(ranks, int) or len(ranks) != num_cores + 1:
        raise ValueError(f"{name} must be a list of {num_cores + 1} ints (ends included), got {ranks!r}")
    ranks = list(ranks)
    for i, r in enumerate(ranks):
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"{name}[{i}] must be an int >= 1 (rank), got {r!r}")
    if ranks[0] != 1 or ranks[-1] != 1:
        raise ValueError(f"{name} must start and end with 1, got {ranks}")
    if caps is not None:
        for i, (r, c) in enumerate(zip(ranks, caps)):
            if r > c:
                raise ValueError(f"{name}[{i}]={r} exceeds the largest useful rank {c} for these modes")
    return ranks


def _check_int(name: str, v: object, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {v!r}")


@lru_cache(maxsize=4096)
def _balanced(n: int, d: int, cap: int) -> tuple[int, ...] | None:
    """Descending factors of ``n`` into ``d`` parts each <= ``cap``, minimizing lexicographically."""
    if d == 1:
        return (n,) if n <= cap else None
    lo = max(1, math.ceil(round(n ** (1.0 / d), 9)))
    for f in range(lo, min(cap, n) + 1):
        if n % f:
            continue
        rest = _balanced(n // f, d - 1, f)
        if rest is not None:
            return (f, *rest)
    return None
