"""Reference contractions for the TT and TTM formats (the specification every fast path is tested against).

Shapes use: T tokens, N_in/N_out the layer sizes, r the middle TT rank,
M1*M2 >= vocabulary rows and N1*N2 = embedding columns of a TTM split in two halves.
"""

from __future__ import annotations

import torch
from torch import Tensor


def tt_linear_lr(x: Tensor, L: Tensor, R: Tensor, bias: Tensor | None = None) -> Tensor:
    """Bidirectional TT linear: ``y = (x L) R + b``.

    x: (T, N_in); L: (N_in, r) input-side cores contracted (middle gate folded in);
    R: (r, N_out) output-side cores contracted. Returns (T, N_out).
    """
    y = (x @ L) @ R  # (T, r) then (T, N_out)
    return y if bias is None else y + bias


def ttm_lookup_pairs(ids: Tensor, A: Tensor, B: Tensor) -> Tensor:
    """TTM embedding lookup from the two pre-contracted halves, never building the table.

    ids: (T,) int64 row ids < M1*M2; A: (M1, N1, r); B: (r, M2, N2). Row id ``i`` splits
    row-major into ``(i // M2, i % M2)``. Duplicate ids are computed once. Returns (T, N1*N2).
    """
    M2, N1, N2 = B.shape[1], A.shape[1], B.shape[2]
    uniq, inverse = torch.unique(ids, return_inverse=True)  # (U,), (T,)
    a = A[uniq // M2]  # (U, N1, r)
    b = B[:, uniq % M2].transpose(0, 1)  # (U, r, N2)
    rows = torch.bmm(a, b).reshape(-1, N1 * N2)  # (U, N1*N2)
    return rows[inverse]  # (T, N1*N2)
