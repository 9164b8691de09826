"""Parameter and FLOP accounting of the TT and TTM formats (formulas only, no tensors)."""

from __future__ import annotations

import math


def tt_params(modes: list[int], ranks: list[int]) -> int:
    """Core parameters ``sum_k r_{k-1} * n_k * r_k`` of a TT with these modes and (active) ranks."""
    _check(modes, ranks)
    return sum(ranks[k] * n * ranks[k + 1] for k, n in enumerate(modes))


def ttm_params(row_modes: list[int], col_modes: list[int], ranks: list[int]) -> int:
    """Core parameters ``sum_k r_{k-1} * m_k * n_k * r_k`` of a TTM (both mode sizes count)."""
    if len(row_modes) != len(col_modes):
        raise ValueError(f"row_modes {row_modes} and col_modes {col_modes} differ in length")
    return tt_params([m * n for m, n in zip(row_modes, col_modes)], ranks)


def from_right(first_rank: int, last_rank: int) -> bool:
    """Whether a chain of cores with outer ranks ``(first_rank, last_rank)`` is contracted right to left.

    The one direction rule of every chain (``tt.chain``, ``contract``'s batched and TTM chains,
    ``chain_flops``): inward from the end whose outer rank is smaller, left to right on a tie, so a
    running product carries one interior rank, never two (the output half ``R``, ranks ``(r_d, 1)``,
    goes right to left).
    """
    return first_rank > last_rank


def chain_flops(modes: list[int], ranks: list[int], *, inward: bool = True) -> int:
    """FLOPs of contracting cores into ``(r_0, prod modes, r_last)`` the way ``tt.chain`` (TT) and
    ``contract._ttm_chain`` (TTM, modes ``m_k n_k``) do: inward from the end whose outer rank is
    smaller (left to right on a tie); ``inward=False`` counts a plain left-to-right sweep (how the
    method doc's reference table builds ``R``)."""
    _check(modes, ranks)
    if inward and from_right(ranks[0], ranks[-1]):
        modes, ranks = list(modes)[::-1], list(ranks)[::-1]
    flops, P = 0, ranks[0] * modes[0]
    for k in range(1, len(modes)):
        flops += 2 * P * ranks[k] * modes[k] * ranks[k + 1]
        P *= modes[k]
    return flops


def tt_lr_flops(tokens: int, in_modes: list[int], out_modes: list[int], ranks: list[int]) -> int:
    """Forward FLOPs of the bidirectional order: build L and R once, then ``(X L) R``."""
    d = len(in_modes)
    build = chain_flops(in_modes, ranks[: d + 1]) + chain_flops(out_modes, ranks[d:])
    return build + tokens * 2 * ranks[d] * (math.prod(in_modes) + math.prod(out_modes))


def tt_sequential_flops(tokens: int, in_modes: list[int], out_modes: list[int], ranks: list[int]) -> int:
    """Forward FLOPs of the core-by-core order through the tokens (nothing is pre-built)."""
    d = len(in_modes)
    per_token, rem = 0, math.prod(in_modes)
    for k, n in enumerate(in_modes):
        rem //= n
        per_token += 2 * ranks[k] * n * ranks[k + 1] * rem
    P = 1
    for k, n in enumerate(out_modes, start=d):
        per_token += 2 * P * ranks[k] * n * ranks[k + 1]
        P *= n
    return tokens * per_token


def tt_dense_flops(tokens: int, in_modes: list[int], out_modes: list[int], ranks: list[int]) -> int:
    """Forward FLOPs of densifying ``W`` then ``X W``."""
    return chain_flops(list(in_modes) + list(out_modes), ranks) + tokens * 2 * math.prod(in_modes) * math.prod(
        out_modes)


def tt_flops_per_token(in_modes: list[int], out_modes: list[int], ranks: list[int], order: str = "lr") -> int:
    """Per-token forward FLOPs of ``order`` (``lr`` | ``sequential`` | ``dense``), batch-independent
    build costs excluded. ``lr`` gives ``2 r_d (N_in + N_out)``."""
    fn = {"lr": tt_lr_flops, "sequential": tt_sequential_flops, "dense": tt_dense_flops}.get(order)
    if fn is None:
        raise ValueError(f"order must be one of lr, sequential, dense, got {order!r}")
    return fn(1, in_modes, out_modes, ranks) - fn(0, in_modes, out_modes, ranks)


def ttm_pair_flops(tokens: int, row_modes: list[int], col_modes: list[int], ranks: list[int]) -> int:
    """Forward FLOPs of the pair lookup: contract both halves once, then one ``(N1 x r)(r x N2)`` per row."""
    h = (len(row_modes) + 1) // 2
    modes = [m * n for m, n in zip(row_modes, col_modes)]
    build = chain_flops(modes[:h], ranks[: h + 1]) + chain_flops(modes[h:], ranks[h:])
    return build + tokens * 2 * math.prod(col_modes[:h]) * ranks[h] * math.prod(col_modes[h:])


def ttm_naive_flops(tokens: int, row_modes: list[int], col_modes: list[int], ranks: list[int]) -> int:
    """Forward FLOPs of the per-core chain: per token, ``(P x r)(r x n r')`` for each core after the first."""
    per_token, P = 0, col_modes[0]
    for k in range(1, len(col_modes)):
        per_token += 2 * P * ranks[k] * col_modes[k] * ranks[k + 1]
        P *= col_modes[k]
    return tokens * per_token


def _check(modes: list[int], ranks: list[int]) -> None:
    if len(ranks) != len(modes) + 1:
        raise ValueError(f"ranks {ranks} must have length len(modes)+1={len(modes) + 1}")
