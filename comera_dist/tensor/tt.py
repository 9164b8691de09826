"""The TT (tensor-train) format of a linear weight: init, densify, TT-SVD.

A weight ``W`` of shape ``(N_in, N_out)`` with ``N_in = prod(in_modes)`` (``d`` cores) and
``N_out = prod(out_modes)`` is stored as cores ``G_k: (r_{k-1}, n_k, r_k)``, input modes first,
row-major (``n_1`` is the most significant input digit). ``masks`` are the masked gate values
``m(g_k)`` of the interior bonds (``len(cores) - 1`` vectors) or ``None``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from comera_dist.tensor.accounting import from_right
from comera_dist.tensor.factorize import check_modes, tt_ranks


def core_stds(ranks: list[int], std: float) -> list[float]:
    """Per-core std so that every entry of the full product has std ``std``.

    ``G_k ~ N(0, 1) / sqrt(r_k) * std^(1/D)``: the product of ``D`` cores summed over the
    interior ranks has variance ``prod_k (std^(2/D) / r_k) * prod(interior ranks) = std^2``.
    """
    if not std > 0:
        raise ValueError(f"init std must be > 0, got {std}")
    D = len(ranks) - 1
    return [std ** (1.0 / D) / math.sqrt(ranks[k + 1]) for k in range(D)]


def tt_init(in_modes: list[int], out_modes: list[int], ranks: list[int], std: float,
            generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32,
            device: torch.device | str | None = None) -> list[Tensor]:
    """Gaussian TT cores ``(r_{k-1}, n_k, r_k)`` whose densified product has entry std ``std``."""
    modes = list(in_modes) + list(out_modes)
    if len(ranks) != len(modes) + 1:
        raise ValueError(f"ranks has length {len(ranks)}, expected {len(modes) + 1} for modes {modes}")
    cores = []
    for k, s in enumerate(core_stds(ranks, std)):
        g = torch.randn(ranks[k], modes[k], ranks[k + 1], generator=generator, dtype=dtype,
                        device=device)  # (r_{k-1}, n_k, r_k)
        cores.append(g * s)
    return cores


def chain(cores: list[Tensor], masks: list[Tensor] | None) -> Tensor:
    """Contract 3-way cores: returns ``(r_0, prod(modes), r_last)``, built inward from the end whose
    outer rank is smaller (``_chain_in``).

    ``masks[k]`` scales bond ``k`` (the right bond of core ``k``). It is applied to the core, the
    smallest tensor touching the bond; ``len(masks) == len(cores)`` also scales the trailing bond
    (the left half of a split carries the middle mask this way).
    """
    out_dtype = cores[0].dtype
    work, no_autocast = build_precision(cores[0])
    with no_autocast:
        cores = scale_bonds([c.to(work) for c in cores], None if masks is None else [m.to(work) for m in masks])
        z = _chain_in(cores)
    return z.to(out_dtype)


def _chain_in(cores: list[Tensor]) -> Tensor:
    """The product of ``cores``, in ``accounting.from_right``'s direction. Left to right, ``R`` (outer
    ranks ``(r_d, 1)``) would hold ``(r_d, P, r_k)``, ``r_k`` times as large as from the right (and as
    costly to build); autograd saves it.
    """
    if from_right(cores[0].shape[0], cores[-1].shape[-1]):
        z = cores[-1]  # (r_{D-1}, n_D, r_D)
        r_last = z.shape[-1]
        for c in cores[-2::-1]:  # c: (r, n, r')
            z = (c.reshape(-1, c.shape[-1]) @ z.reshape(c.shape[-1], -1)).reshape(c.shape[0], -1, r_last)  # (r, n*P, r_D)
        return z
    z = cores[0]  # (r0, n_1, r_1)
    r0 = z.shape[0]
    for c in cores[1:]:  # c: (r, n, r')
        z = (z.reshape(-1, c.shape[0]) @ c.reshape(c.shape[0], -1)).reshape(r0, -1, c.shape[-1])  # (r0, P*n, r')
    return z


def build_precision(like: Tensor) -> tuple[torch.dtype, torch.autocast]:
    """How to run a batch-independent build (L, R, TTM halves, a dense W): ``(dtype, context)`` =
    fp32 or wider, and a context that turns autocast off (a plain object: torch.compile traces it).

    Under bf16 (DeepSpeed's bf16 module cast, or ``torch.autocast``) a chain of small core products
    would round every partial product to 8 mantissa bits; the build is tiny next to the per-token
    work, so it runs in fp32 with autocast off, and the caller casts the result back to the cores'
    dtype (under autocast the per-token matmul then casts as usual).
    """
    work = torch.promote_types(like.dtype, torch.float32)
    device_type = like.device.type if like.device.type in ("cpu", "cuda") else "cpu"  # meta: nothing to undo
    return work, torch.autocast(device_type, enabled=False)


def matmul_operand_dtype(like: Tensor) -> torch.dtype:
    """The dtype to hand a build's result (``like``: a core) to per-token matmuls in: autocast's dtype
    when autocast is on for ``like``'s device and would cast it (every float but fp64), since each
    matmul would round it to that dtype anyway; else ``like``'s own. For results that only matmuls
    consume: a stack of factors cast once costs one cast (and one for its gradient) instead of one per
    layer, and each layer's slice holds the very values the matmul's own cast would have made."""
    device_type = like.device.type
    if device_type in ("cpu", "cuda") and like.dtype != torch.float64 and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return like.dtype


def scale_bonds(cores: list[Tensor], masks: list[Tensor] | None) -> list[Tensor]:
    """``cores[k] * masks[k]`` along the last (right-bond) dim, for every mask given."""
    if masks is None:
        return list(cores)
    if len(masks) > len(cores):
        raise ValueError(f"{len(masks)} masks for {len(cores)} cores: at most one per core")
    return [c * masks[k] if k < len(masks) else c for k, c in enumerate(cores)]


def tt_to_dense(cores: list[Tensor], masks: list[Tensor] | None, d: int) -> Tensor:
    """The full weight ``(N_in, N_out)`` of a TT with ``d`` input cores (test oracle; small layers)."""
    n_in = math.prod(c.shape[1] for c in cores[:d])
    return chain(cores, masks).reshape(n_in, -1)  # (N_in, N_out)


def tt_svd_modes(t: Tensor, modes: list[int], ranks: list[int]) -> list[Tensor]:
    """TT-SVD of a tensor with ``prod(modes)`` entries into cores ``(r_{k-1}, modes[k], r_k)``.

    Left-to-right sweep: each step keeps the top ``r_k`` singular triplets and pushes ``S V^T``
    into the remainder, so the result is exact when every ``r_k`` reaches the unfolding rank
    (in particular at the caps of ``tt_ranks``). Runs in float64 for accuracy.
    """
    dtype = t.dtype
    rest = t.reshape(1, -1).to(torch.float64)  # (r_0, remaining)
    cores = []
    for k, n in enumerate(modes[:-1]):
        mat = rest.reshape(ranks[k] * n, -1)  # (r_{k-1} n_k, remaining)
        u, s, vh = torch.linalg.svd(mat, full_matrices=False)
        r = ranks[k + 1]
        if r > s.shape[0]:
            raise ValueError(f"rank {r} at bond {k + 1} exceeds the unfolding rank limit {s.shape[0]}")
        cores.append(u[:, :r].reshape(ranks[k], n, r).to(dtype))  # (r_{k-1}, n_k, r_k)
        rest = s[:r, None] * vh[:r]  # (r_k, remaining)
    cores.append(rest.reshape(ranks[-2], modes[-1], 1).to(dtype))
    return _balance(cores)


def tt_svd(W: Tensor, in_modes: list[int], out_modes: list[int], max_rank: int,
           ranks: list[int] | None = None) -> list[Tensor]:
    """TT-SVD of ``W (N_in, N_out)``; exact when ``max_rank`` reaches the ``tt_ranks`` caps.

    ``ranks`` (full profile) overrides ``tt_ranks(modes, max_rank)``.
    """
    check_modes("in_modes", in_modes, W.shape[0])
    check_modes("out_modes", out_modes, W.shape[1])
    modes = list(in_modes) + list(out_modes)
    return tt_svd_modes(W, modes, tt_ranks(modes, max_rank) if ranks is None else ranks)


def _balance(cores: list[Tensor]) -> list[Tensor]:
    """Spread the norm evenly over the cores (the product is unchanged).

    TT-SVD leaves all of it in the last core; equal core norms give every core a comparable
    gradient scale when training starts from an SVD.
    """
    norms = [c.norm() for c in cores]
    if any(n == 0 for n in norms):
        return cores
    target = math.exp(sum(math.log(float(n)) for n in norms) / len(cores))
    return [c * (target / float(n)) for c, n in zip(cores, norms)]
