"""TiedTTHead: an output head tied to a ``TTEmbedding``: ``logits = h E^T + b`` from the embedding's cores.

The head owns no cores or gates. It reads the embedding's ``core`` and ``gate`` (the same
``Parameter`` objects) at every call, so the gradient of the logits flows into the embedding's
cores and gate, a prune of the embedding (``prune_`` replaces its Parameters) is seen at once,
and the accounting, the pruning plan and the optimizer meet each shared Parameter exactly once,
under the embedding's name. For that reason the embedding is held outside ``nn.Module``'s
registries (a plain attribute, not a submodule): ``named_modules``, ``state_dict`` and DeepSpeed's
module walk see it only where the model registers it. Under ZeRO-3 DeepSpeed gathers the
embedding's partitioned cores when this module's forward touches them (its parameter getter
registers them as external parameters of this module).

The contraction never builds ``E``: the cores are cut at one bond into two halves and the tokens
go through one half, then the other; ``tensor.cost.choose_ttm_head_order`` picks the cut and the
side from FLOPs and saved bytes (``order`` forces one; ``"dense"`` builds E, for tests and
comparisons). The TTM rows are padded up to ``prod(row_modes)``: the padding columns are dropped,
so the logits have exactly ``num_embeddings`` columns.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from comera_dist.layers.embedding import TTEmbedding
from comera_dist.tensor import contract
from comera_dist.tensor.cost import Order, choose_ttm_head_order, parse_ttm_head_order, ttm_head_costs
from comera_dist.tensor.smallops import on_one_thread


class TiedTTHead(nn.Module):
    """``(..., embedding_dim) -> (..., num_embeddings)`` through the tied ``TTEmbedding``'s cores, plus a dense bias."""

    def __init__(self, embedding: TTEmbedding, *, bias: bool = True, order: str = "auto") -> None:
        super().__init__()
        if not isinstance(embedding, TTEmbedding):
            raise TypeError(f"embedding must be a TTEmbedding, got {type(embedding).__name__}")
        self._tied = (embedding,)  # a tuple: not a submodule (see the module docstring)
        self.in_features, self.out_features = embedding.embedding_dim, embedding.num_embeddings
        self.order = order
        self.bias = nn.Parameter(torch.zeros(embedding.num_embeddings, dtype=embedding.core.dtype,
                                             device=embedding.core.device)) if bias else None

    @property
    def embedding(self) -> TTEmbedding:
        """The tied embedding (its cores and gates are this head's weights)."""
        return self._tied[0]

    @property
    def order(self) -> str:
        """``auto`` (the cost model) or a forced order name of ``tensor.cost.ttm_head_orders``."""
        return self._order

    @order.setter
    def order(self, value: str) -> None:
        if value != "auto":
            parse_ttm_head_order(value, self.embedding.num_cores)  # raises ValueError naming the order
        self._order = value

    # ---- cost model ------------------------------------------------------------------------

    def order_costs(self, tokens: int, active: bool = True) -> dict[str, Order]:
        """Every order's predicted cost for ``tokens`` tokens at the current (active or physical) ranks."""
        e = self.embedding
        return ttm_head_costs(tokens, e.row_modes, e.col_modes, e.full_ranks(active))

    def chosen_order(self, tokens: int) -> str:
        """The order ``forward`` runs for ``tokens`` tokens (``order`` if forced, else the cost model's)."""
        if self._order != "auto":
            return self._order
        e = self.embedding
        return choose_ttm_head_order(tokens, e.row_modes, e.col_modes, e.full_ranks(active=False)).name

    def flops_per_token(self, active: bool = True) -> int:
        """Per-token forward FLOPs (builds excluded) of the order ``forward`` runs for 4096 tokens."""
        name = self.chosen_order(4096)
        return self.order_costs(1, active)[name].flops - self.order_costs(0, active)[name].flops

    # ---- forward -------------------------------------------------------------------------------

    def forward(self, h: Tensor) -> Tensor:
        """h: (..., embedding_dim) -> logits (..., num_embeddings)."""
        e = self.embedding
        if h.shape[-1] != e.embedding_dim:
            raise ValueError(f"h must end in embedding_dim={e.embedding_dim}, got shape {tuple(h.shape)}")
        x = h.reshape(-1, e.embedding_dim)  # (T, N)
        split, side = parse_ttm_head_order(self.chosen_order(x.shape[0]), e.num_cores)
        if side == "dense":
            logits = contract.ttm_head_dense(x, e.core_list(), e.masked_gates())  # (T, M)
        else:
            left, right = on_one_thread(lambda c, g: contract.ttm_head_halves(e.split_cores(c), e._mask(g), split),
                                        e.core, e.gate)
            logits = contract.ttm_head_contract(x, left, right, side)  # (T, M) padded rows included
        logits = logits[:, : e.num_embeddings]  # (T, V)
        if e.padding_idx is not None:  # the table's padding row is zero (TTEmbedding.table)
            logits = logits.index_fill(1, torch.tensor([e.padding_idx], device=logits.device), 0.0)
        if self.bias is not None:
            logits = logits + self.bias.to(logits.dtype)  # an fp32 bias must not promote bf16 (autocast) logits
        return logits.reshape(*h.shape[:-1], e.num_embeddings)

    # ---- conversion ----------------------------------------------------------------------------

    def dense_weight(self) -> Tensor:
        """The equivalent dense weight ``(num_embeddings, embedding_dim)`` (= the embedding's table)."""
        return self.embedding.table()

    @torch.no_grad()
    def to_linear(self) -> nn.Linear:
        """A dense ``nn.Linear`` holding a copy of the table (untied; tests and export)."""
        w = self.dense_weight()
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, dtype=w.dtype,
                        device=w.device)
        lin.weight.copy_(w)
        if self.bias is not None:
            lin.bias.copy_(self.bias)
        return lin

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, bias={self.bias is not None}, order={self._order!r}, tied"
