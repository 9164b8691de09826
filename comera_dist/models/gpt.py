"""GPT-like causal decoder: pre-LayerNorm blocks, GELU, learned positions, LM head (GPT-2 layout).

The next-token shift happens inside ``forward``: ``labels`` are the input ids
(-100 where no loss is wanted), logits at position t predict label t+1.
With ``tie_word_embeddings`` the LM head is the word table: a ``Linear`` sharing a dense table, or a
``TiedTTHead`` computing ``h E^T`` from a TTM table's cores and gates; untied, its own dense ``Linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from comera_dist.layers.group import Factors, shared_factors_and_penalty
from comera_dist.models.blocks import (
    FeedForward,
    SelfAttention,
    block_factors_skipped,
    check_inputs,
    run_blocks,
)
from comera_dist.models.config import ModelConfig
from comera_dist.models.cpu_dropout import Dropout
from comera_dist.models.factory import TensorizeSpec, make_embedding, make_output_head
from comera_dist.models.token_loss import IGNORE_INDEX, token_cross_entropy


class PreLNBlock(nn.Module):
    """``x = x + attn(LN(x)); x = x + ffn(LN(x))`` with causal attention."""

    def __init__(self, cfg: ModelConfig, spec: TensorizeSpec | None):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = SelfAttention(cfg, spec, causal=True)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg, spec)
        self.drop = Dropout(cfg.dropout)

    def forward(self, x: Tensor, keep: Tensor | None, factors: Factors | None = None) -> Tensor:
        """x: (B, T, C); keep: (B, T) bool or None; factors: shared TT factors or None -> (B, T, C)."""
        x = x + self.drop(self.attn(self.attn_norm(x), keep, factors))  # (B, T, C)
        return x + self.drop(self.ffn(self.ffn_norm(x), factors))  # (B, T, C)


class GPT(nn.Module):
    """word (dense or TTM) + position -> ``num_layers`` pre-LN blocks -> LN -> LM head (no bias)."""

    def __init__(self, cfg: ModelConfig, spec: TensorizeSpec | None = None):
        super().__init__()
        self.config = cfg
        self.word = make_embedding(spec, cfg.vocab_size, cfg.hidden_size, init_std=cfg.init_std)
        self.position = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        nn.init.normal_(self.position.weight, std=cfg.init_std)
        self.drop = Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(PreLNBlock(cfg, spec) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.lm_head = make_output_head(self.word, tie=cfg.tie_word_embeddings, bias=False, init_std=cfg.init_std)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                labels: Tensor | None = None) -> dict[str, Tensor | None]:
        """input_ids, attention_mask, labels: (B, T). Returns loss (shifted next-token CE), logits (B, T, V) and
        rank_penalty (R from the forward's own masks; None for a dense model and under ZeRO-3)."""
        keep = check_inputs(self.config, input_ids, attention_mask)
        # every TT linear's L/R (same-shape layers contracted together; with model.recompute_factors each
        # recomputed block contracts its own) and the rank penalty R from the same masks
        factors, penalty = shared_factors_and_penalty(self, skip=block_factors_skipped(self))
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)  # (T,)
        x = self.drop(self.word(input_ids) + self.position(pos))  # (B, T, C)
        x = run_blocks(self, x, keep, factors)  # (B, T, C)
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        loss = None
        if labels is not None:
            # position t predicts label t+1; the last position predicts nothing (no copy of the logits)
            targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # (B, T)
            loss = token_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return {"loss": loss, "logits": logits, "rank_penalty": penalty}
