"""The TTM (TT-matrix) format of an embedding table: init, densify, TT-SVD.

A table ``E`` of shape ``(V, N)`` with ``V <= prod(row_modes)`` and ``N = prod(col_modes)`` is
stored as cores ``F_k: (r_{k-1}, m_k, n_k, r_k)``; row ``i`` has row-major digits over ``m``
(``m_1`` most significant), column ``j`` over ``n``. Rows ``V..prod(m)-1`` are padding and never read.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from comera_dist.tensor.factorize import check_modes, tt_ranks
from comera_dist.tensor.tt import core_stds, tt_svd_modes


def ttm_init(row_modes: list[int], col_modes: list[int], ranks: list[int], std: float,
             generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32,
             device: torch.device | str | None = None) -> list[Tensor]:
    """Gaussian TTM cores ``(r_{k-1}, m_k, n_k, r_k)``; every table entry has std ``std``."""
    if len(row_modes) != len(col_modes):
        raise ValueError(f"row_modes {row_modes} and col_modes {col_modes} must have the same length")
    if len(ranks) != len(row_modes) + 1:
        raise ValueError(f"ranks has length {len(ranks)}, expected {len(row_modes) + 1}")
    cores = []
    for k, s in enumerate(core_stds(ranks, std)):
        f = torch.randn(ranks[k], row_modes[k], col_modes[k], ranks[k + 1], generator=generator,
                        dtype=dtype, device=device)  # (r_{k-1}, m_k, n_k, r_k)
        cores.append(f * s)
    return cores


def ttm_to_dense(cores: list[Tensor], masks: list[Tensor] | None) -> Tensor:
    """The full table ``(prod m, prod n)`` including padding rows (test oracle; small tables only)."""
    z = cores[0][0]  # (m_1, n_1, r_1)
    for k in range(1, len(cores)):
        if masks is not None:
            z = z * masks[k - 1]  # (M, N, r_k)
        c = cores[k]  # (r, m, n, r')
        M, N = z.shape[0], z.shape[1]
        z = torch.einsum("MNr,rmns->MmNns", z, c).reshape(M * c.shape[1], N * c.shape[2], c.shape[3])
    return z[..., 0]  # (prod m, prod n)


def ttm_svd(E: Tensor, row_modes: list[int], col_modes: list[int], max_rank: int,
            ranks: list[int] | None = None) -> list[Tensor]:
    """TT-SVD of a table ``E (V, N)`` into TTM cores; padding rows are zero; exact at the rank caps.

    ``ranks`` (full profile) overrides ``tt_ranks(m_k * n_k, max_rank)``.
    """
    V, N = E.shape
    row_modes = check_modes("row_modes", row_modes, V, at_least=True)
    col_modes = check_modes("col_modes", col_modes, N)
    if len(row_modes) != len(col_modes):
        raise ValueError(f"row_modes {row_modes} and col_modes {col_modes} must have the same length")
    d = len(row_modes)
    full = torch.zeros(math.prod(row_modes), N, dtype=E.dtype, device=E.device)
    full[:V] = E  # (prod m, N), padding rows zero
    t = full.reshape(*row_modes, *col_modes)  # (m_1..m_d, n_1..n_d)
    perm = [i for k in range(d) for i in (k, d + k)]  # interleave (m_1, n_1, m_2, n_2, ...)
    t = t.permute(*perm).contiguous()
    modes = [m * n for m, n in zip(row_modes, col_modes)]
    cores = tt_svd_modes(t, modes, tt_ranks(modes, max_rank) if ranks is None else ranks)
    return [c.reshape(c.shape[0], m, n, c.shape[2]) for c, m, n in zip(cores, row_modes, col_modes)]
