"""Contraction-order cost model for the TT linear layer: FLOPs plus saved-activation bytes.

Three orders compute the same ``y = x W``:

- ``lr``: build ``L (N_in, r_d)`` and ``R (r_d, N_out)`` once, then ``(x L) R``; per token
  ``2 r_d (N_in + N_out)``; saves ``x L`` (T r_d) plus L and R.
- ``sequential``: contract the tokens through one core at a time; nothing batch-independent to
  build, so it wins for a handful of tokens, and for a huge middle rank ``r_d``; saves the
  state entering every core, per token.
- ``dense``: densify ``W`` and run one GEMM; wins only when the ranks are near full.

The score is a time model, ``flops + flops_per_byte * saved_bytes``: a saved activation is
written in forward and read back in backward, and on a bandwidth-bound machine one byte moved
costs about as much time as ``flops_per_byte`` FLOPs. ``memory_budget`` (bytes) excludes any order
that would save more.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from comera_dist.tensor.accounting import chain_flops, tt_dense_flops, tt_lr_flops, tt_sequential_flops

ORDERS: tuple[str, ...] = ("lr", "sequential", "dense")


@dataclass(frozen=True, slots=True)
class Order:
    """One contraction order and its predicted cost for a token count."""

    name: str
    """``lr`` | ``sequential`` | ``dense``."""
    flops: int
    """Forward FLOPs for all tokens, batch-independent builds included."""
    saved_bytes: int
    """Bytes of tensors autograd keeps for backward beyond the input and the parameters. The
    per-token part is exact for this package's implementations (tested with saved-tensor hooks);
    the batch-independent part (build intermediates) is approximate."""
    score: float
    """``flops + flops_per_byte * saved_bytes``: what ``choose_order`` minimizes."""


def order_costs(tokens: int, in_modes: list[int], out_modes: list[int], ranks: list[int], *,
                bytes_per_element: int = 4, flops_per_byte: float = 4.0, gelu_input: bool = False) -> dict[str, Order]:
    """The predicted cost of every order.

    ``gelu_input``: the layer applies GELU to its input first (``TTLinear(..., gelu_input=True)``).
    Only ``lr`` fuses it (``tensor.fused``); ``dense`` then also keeps ``gelu(x)`` for backward
    (``sequential`` keeps a reshaped copy of its input in any case, counted already).
    """
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    d = len(in_modes)
    n_in, n_out, r_d = math.prod(in_modes), math.prod(out_modes), ranks[d]
    modes = list(in_modes) + list(out_modes)
    # Chain intermediates of a build, each half contracted inward from its rank-1 end (``tt.chain``):
    # (prod of modes so far) x the open rank, for every step.
    build_in = sum(math.prod(in_modes[:k + 1]) * ranks[k + 1] for k in range(d))
    out_rev, ranks_rev = out_modes[::-1], ranks[d:][::-1]
    build_out = sum(math.prod(out_rev[:k + 1]) * ranks_rev[k + 1] for k in range(len(out_modes)))
    build_all = sum(math.prod(modes[:k + 1]) * ranks[k + 1] for k in range(len(modes)))
    # Sequential: each step's einsum keeps its input state (x's reshaped copy included).
    seq, rem, P = 0, n_in, 1
    for k, n in enumerate(in_modes):
        seq += rem * ranks[k]
        rem //= n
    for k, n in enumerate(out_modes, start=d):
        seq += P * ranks[k]
        P *= n
    elems = {
        "lr": tokens * r_d + build_in + build_out,
        "sequential": tokens * seq,
        "dense": build_all + n_in * n_out,
    }
    if gelu_input:  # x W keeps gelu(x); sequential keeps its own reshaped copy of its input either way
        elems["dense"] += tokens * n_in
    flops = {
        "lr": tt_lr_flops(tokens, in_modes, out_modes, ranks),
        "sequential": tt_sequential_flops(tokens, in_modes, out_modes, ranks),
        "dense": tt_dense_flops(tokens, in_modes, out_modes, ranks),
    }
    out = {}
    for name in ORDERS:
        b = elems[name] * bytes_per_element
        out[name] = Order(name=name, flops=flops[name], saved_bytes=b, score=flops[name] + flops_per_byte * b)
    return out


@lru_cache(maxsize=1024)
def _choose(tokens: int, in_modes: tuple[int, ...], out_modes: tuple[int, ...], ranks: tuple[int, ...],
            bytes_per_element: int, flops_per_byte: float, memory_budget: int | None, gelu_input: bool) -> Order:
    costs = order_costs(tokens, list(in_modes), list(out_modes), list(ranks),
                        bytes_per_element=bytes_per_element, flops_per_byte=flops_per_byte, gelu_input=gelu_input)
    # Plain loops rather than min(key=...): torch.compile traces this without a graph break.
    best: Order | None = None
    for name in ORDERS:  # ties go to the earlier order
        o = costs[name]
        if (memory_budget is None or o.saved_bytes <= memory_budget) and (best is None or o.score < best.score):
            best = o
    if best is None:  # nothing fits: the least memory wins
        for o in costs.values():
            if best is None or (o.saved_bytes, o.flops) < (best.saved_bytes, best.flops):
                best = o
    assert best is not None
    return best


def choose_order(tokens: int, in_modes: list[int], out_modes: list[int], ranks: list[int], d: int | None = None,
                 *, bytes_per_element: int = 4, flops_per_byte: float = 4.0,
                 memory_budget: int | None = None, gelu_input: bool = False) -> Order:
    """The cheapest order for ``tokens`` tokens (see the module docstring); ``d`` = len(in_modes);
    ``gelu_input`` as in ``order_costs``."""
    if d is not None and d != len(in_modes):
        raise ValueError(f"d={d} differs from len(in_modes)={len(in_modes)}")
    if len(ranks) != len(in_modes) + len(out_modes) + 1:
        raise ValueError(f"ranks {ranks} must have length {len(in_modes) + len(out_modes) + 1}")
    choose = _choose.__wrapped__ if torch.compiler.is_compiling() else _choose  # dynamo skips lru_cache
    return choose(int(tokens), tuple(in_modes), tuple(out_modes), tuple(ranks), bytes_per_element,
                   float(flops_per_byte), memory_budget, bool(gelu_input))


# --------------------------------------------------------------------------------------------
# Tied output head: logits = h E^T straight from the TTM cores of the embedding E.
# --------------------------------------------------------------------------------------------
#
# Split the cores at bond c into a left half ``Lc (M_L, N_L, r_c)`` and a right half
# ``Rc (r_c, M_R, N_R)`` (both batch-independent, built once per step), then contract the tokens
# ``h (T, N_L, N_R)`` with one half first:
#
# - ``split{c}_left``:  X = h Lc  (T, M_L, r_c, N_R),  2 T N M_L r_c;  logits = X Rc, 2 T M N_R r_c
# - ``split{c}_right``: Y = h Rc  (T, N_L, r_c, M_R),  2 T N M_R r_c;  logits = Lc Y, 2 T M N_L r_c
#
# (M = M_L M_R the padded vocabulary). The second GEMM is where the vocabulary is paid for, at
# ``2 M r_c x (the column modes left on the other side)`` per token, so the cheapest split puts few
# column modes and many row modes on one end. ``dense`` (build E, one GEMM: ``2 T M N``) is costed for
# comparison only: the head is meant never to build the table, so ``choose_ttm_head_order`` skips it
# unless ``allow_dense``.


def ttm_head_orders(num_cores: int) -> tuple[str, ...]:
    """Every order name of the tied head for a TTM of ``num_cores`` cores (``dense`` last)."""
    if num_cores < 2:
        raise ValueError(f"num_cores must be >= 2 for a TTM, got {num_cores}")
    return tuple(f"split{c}_{side}" for c in range(1, num_cores) for side in ("left", "right")) + ("dense",)


def parse_ttm_head_order(name: str, num_cores: int) -> tuple[int, str]:
    """``"split{c}_{left|right}"`` -> ``(c, side)``; ``dense`` -> ``(0, "dense")``; else ``ValueError``."""
    if name not in ttm_head_orders(num_cores):
        raise ValueError(f"order must be 'auto' or one of {list(ttm_head_orders(num_cores))}, got {name!r}")
    if name == "dense":
        return 0, "dense"
    split, side = name[len("split"):].split("_")
    return int(split), side


def ttm_head_costs(tokens: int, row_modes: list[int], col_modes: list[int], ranks: list[int], *,
                   bytes_per_element: int = 4, flops_per_byte: float = 4.0) -> dict[str, Order]:
    """Predicted forward FLOPs and saved bytes of every order of ``h (tokens, N) @ E^T (N, M)``.

    ranks: the full profile ``[1, r_1, ..., r_{D-1}, 1]``. FLOPs include the batch-independent
    builds of the halves (``chain_flops`` on the ``m_k n_k`` modes); saved bytes count the per-token
    intermediate each order keeps for backward plus the halves (the input ``h`` is not counted).
    """
    D = len(row_modes)
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    if D < 2 or len(col_modes) != D:
        raise ValueError(f"row_modes {list(row_modes)} and col_modes {list(col_modes)} must be of equal length >= 2")
    if len(ranks) != D + 1:
        raise ValueError(f"ranks {list(ranks)} must have length {D + 1}")
    modes = [m * n for m, n in zip(row_modes, col_modes)]
    M, N = math.prod(row_modes), math.prod(col_modes)
    flops: dict[str, int] = {}
    elems: dict[str, int] = {}
    for c in range(1, D):
        r = ranks[c]
        ML, MR = math.prod(row_modes[:c]), math.prod(row_modes[c:])
        NL, NR = math.prod(col_modes[:c]), math.prod(col_modes[c:])
        build = chain_flops(modes[:c], ranks[:c + 1]) + chain_flops(modes[c:], ranks[c:])
        halves = ML * NL * r + r * MR * NR
        flops[f"split{c}_left"] = build + tokens * 2 * r * (N * ML + M * NR)
        elems[f"split{c}_left"] = halves + tokens * ML * r * NR
        flops[f"split{c}_right"] = build + tokens * 2 * r * (N * MR + M * NL)
        elems[f"split{c}_right"] = halves + tokens * NL * r * MR
    flops["dense"] = chain_flops(modes, ranks) + tokens * 2 * M * N
    elems["dense"] = M * N
    out = {}
    for name in ttm_head_orders(D):
        b = elems[name] * bytes_per_element
        out[name] = Order(name=name, flops=flops[name], saved_bytes=b, score=flops[name] + flops_per_byte * b)
    return out


def choose_ttm_head_order(tokens: int, row_modes: list[int], col_modes: list[int], ranks: list[int], *,
                          allow_dense: bool = False, bytes_per_element: int = 4,
                          flops_per_byte: float = 4.0) -> Order:
    """The cheapest tied-head order by ``ttm_head_costs``' score (ties go to the earlier split)."""
    costs = ttm_head_costs(tokens, row_modes, col_modes, ranks, bytes_per_element=bytes_per_element,
                           flops_per_byte=flops_per_byte)
    best: Order | None = None
    for name, o in costs.items():  # a plain loop: torch.compile traces it without a graph break
        if (allow_dense or name != "dense") and (best is None or o.score < best.score):
            best = o
    assert best is not None
    return best
