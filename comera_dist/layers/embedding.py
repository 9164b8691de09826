"""TTEmbedding: an embedding table stored only as gated TTM cores, looked up without the table.

Forward pre-contracts the cores into two halves ``A (M1, N1, r)`` and ``B (r, M2, N2)``
(``tensor.contract.ttm_pair_contract``, any number of cores), then gathers and multiplies one
``(N1 x r)(r x N2)`` per distinct token id (``kernels.dispatch.ttm_lookup``).

Initialization (documented choice): every table entry has std ``1/sqrt(embedding_dim)``, so a row
has unit expected norm. The reference uses std 1 (``nn.Embedding``'s default), which makes row norms
``sqrt(embedding_dim)`` (27.7 at 768) and, with a tied output head, logits that scale with it; pass
``init_std=1.0`` to get the reference behaviour.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from comera_dist.kernels import dispatch
from comera_dist.layers.base import TensorizedModule
from comera_dist.tensor import accounting, contract
from comera_dist.tensor.factorize import check_modes, check_ranks, factorize, factorize_at_least, tt_ranks
from comera_dist.tensor.smallops import on_one_thread
from comera_dist.tensor.ttm import ttm_init, ttm_svd, ttm_to_dense


class TTEmbedding(TensorizedModule):
    """``nn.Embedding`` replacement over TTM cores ``(r_{k-1}, m_k, n_k, r_k)``.

    Row modes default to ``factorize_at_least(num_embeddings, num_cores)`` (their product may
    exceed the vocabulary: padding rows are never read) and column modes to the ascending
    factorization of ``embedding_dim``. ``padding_idx`` rows come out as zeros with no gradient.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, row_modes: list[int] | None = None,
                 col_modes: list[int] | None = None, num_cores: int = 4, max_rank: int = 32,
                 ranks: list[int] | None = None, padding_idx: int | None = None, tau: float = 1e-2,
                 init_std: float | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, generator: torch.Generator | None = None) -> None:
        super().__init__()
        for name, v in (("num_embeddings", num_embeddings), ("embedding_dim", embedding_dim)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if not isinstance(num_cores, int) or isinstance(num_cores, bool) or num_cores < 2:
            raise ValueError(f"num_cores must be an int >= 2, got {num_cores!r}")
        d = num_cores if row_modes is None else len(row_modes)
        self.row_modes = factorize_at_least(num_embeddings, d) if row_modes is None else \
            check_modes("row_modes", row_modes, num_embeddings, at_least=True)
        self.col_modes = factorize(embedding_dim, d)[::-1] if col_modes is None else \
            check_modes("col_modes", col_modes, embedding_dim)
        if len(self.row_modes) != len(self.col_modes):
            raise ValueError(f"row_modes {self.row_modes} and col_modes {self.col_modes} must have the same "
                             f"number of cores")
        if len(self.row_modes) < 2:
            raise ValueError(f"a TTM embedding needs at least 2 cores, got row_modes={self.row_modes}")
        if padding_idx is not None:
            if padding_idx < 0:
                padding_idx += num_embeddings
            if not 0 <= padding_idx < num_embeddings:
                raise ValueError(f"padding_idx must be within [-{num_embeddings}, {num_embeddings}), "
                                 f"got {padding_idx}")
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        modes = [m * n for m, n in zip(self.row_modes, self.col_modes)]
        if ranks is None:
            ranks = tt_ranks(modes, max_rank)
        ranks = check_ranks("ranks", ranks, len(modes), tt_ranks(modes, 10**9))
        if init_std is None:
            init_std = 1.0 / math.sqrt(embedding_dim)
        dtype = dtype or torch.get_default_dtype()
        self._init_state(ttm_init(self.row_modes, self.col_modes, ranks, init_std, generator, dtype, device), tau)

    # ---- conversion ------------------------------------------------------------------------

    @classmethod
    def from_dense(cls, table: Tensor, *, max_rank: int, num_cores: int = 4, **kwargs: Any) -> TTEmbedding:
        """TT-SVD of ``table (V, N)`` into TTM cores; exact when ``max_rank`` reaches the rank caps."""
        if table.dim() != 2:
            raise ValueError(f"table must be 2-D (num_embeddings, embedding_dim), got shape {tuple(table.shape)}")
        w = table.detach()
        layer = cls(w.shape[0], w.shape[1], max_rank=max_rank, num_cores=num_cores, dtype=w.dtype,
                    device=w.device, **kwargs)
        cores = ttm_svd(w, layer.row_modes, layer.col_modes, max_rank, ranks=layer.full_ranks(active=False))
        with torch.no_grad():
            for p, c in zip(layer.cores, cores):
                p.copy_(c)
        return layer

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, *, max_rank: int, num_cores: int = 4,
                       **kwargs: Any) -> TTEmbedding:
        """TT-SVD of ``embedding.weight`` (``padding_idx`` carried over); exact at the rank caps."""
        kwargs.setdefault("padding_idx", embedding.padding_idx)
        return cls.from_dense(embedding.weight, max_rank=max_rank, num_cores=num_cores, **kwargs)

    def to_dense(self) -> Tensor:
        """Alias of ``table()``: the masked dense table ``(num_embeddings, embedding_dim)``."""
        return self.table()

    def table(self) -> Tensor:
        """The masked dense table ``(num_embeddings, embedding_dim)`` (tests, export; never in forward)."""
        t = ttm_to_dense(self.core_list(), self.masked_gates())[: self.num_embeddings]  # (V, N)
        if self.padding_idx is not None:
            t = t.index_fill(0, torch.tensor([self.padding_idx], device=t.device), 0.0)
        return t

    @torch.no_grad()
    def to_embedding(self) -> nn.Embedding:
        """An ``nn.Embedding`` holding the densified (masked) table."""
        t = self.table()
        out = nn.Embedding(self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx, dtype=t.dtype,
                           device=t.device)
        out.weight.copy_(t)
        return out

    # ---- forward -------------------------------------------------------------------------------

    def forward(self, ids: Tensor) -> Tensor:
        """ids: (...) int64 in ``[0, num_embeddings)`` -> (..., embedding_dim)."""
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids must be int64 or int32 token ids, got dtype {ids.dtype}")
        flat = ids.reshape(-1).long()  # (T,)
        # The range check reads the ids on the host: CPU eager only (on a GPU it would sync, under
        # torch.compile break the graph); one read, the message's min/max only on failure.
        if dispatch.host_work_ok(flat) and flat.numel() and \
                bool(((flat < 0) | (flat >= self.num_embeddings)).any()):
            raise ValueError(f"ids must lie in [0, {self.num_embeddings}), got min {int(flat.min())} "
                             f"max {int(flat.max())}")
        A, B = on_one_thread(lambda c, g: contract.ttm_pair_contract(self.split_cores(c), self._mask(g)),
                             self.core, self.gate)  # (M1, N1, r), (r, M2, N2)
        rows = dispatch.ttm_lookup(flat, A, B)  # (T, N)
        if self.padding_idx is not None:
            rows = rows * (flat != self.padding_idx).unsqueeze(-1).to(rows.dtype)  # zero rows, zero gradient
        return rows.reshape(*ids.shape, self.embedding_dim)

    # ---- accounting ----------------------------------------------------------------------------

    def param_count(self, active: bool = True) -> int:
        """Core parameters with active or physical ranks; both mode sizes ``m_k * n_k`` count."""
        return accounting.ttm_params(self.row_modes, self.col_modes, self.full_ranks(active))

    def dense_param_count(self) -> int:
        """Parameters of the dense table this layer replaces."""
        return self.num_embeddings * self.embedding_dim

    def flops_per_token(self, active: bool = True) -> int:
        """Per-token forward FLOPs of the pair lookup (one ``(N1 x r)(r x N2)``; dedup not counted)."""
        r = self.full_ranks(active)
        return accounting.ttm_pair_flops(1, self.row_modes, self.col_modes, r) - \
            accounting.ttm_pair_flops(0, self.row_modes, self.col_modes, r)

    def tensor_shapes(self) -> dict[str, Any]:
        """What rebuilds this layer's shapes: ``TTEmbedding(V, N, **shapes)``."""
        return {"row_modes": list(self.row_modes), "col_modes": list(self.col_modes),
                "ranks": self.full_ranks(active=False)}

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, row_modes={self.row_modes}, "
                f"col_modes={self.col_modes}, ranks={self.full_ranks(active=False)}, padding_idx={self.padding_idx}")

