"""BERT-like encoder with a masked-language-model head (the CodeBERT-like model of the paper).

Post-LayerNorm blocks, GELU, learned positions; the head is BERT's
``dense -> GELU -> LayerNorm -> decoder``. With ``tie_word_embeddings`` the decoder is the word
table: a dense ``Linear`` sharing an ``nn.Embedding``'s weight, or, with a TT (TTM) table, a
``TiedTTHead`` computing ``h E^T`` from the embedding's cores and gates (never building E); its
bias stays dense. Untied, the decoder is its own dense ``Linear``.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from comera_dist.layers.group import shared_factors_and_penalty
from comera_dist.models.blocks import (
    BertEmbeddings,
    PostLNBlock,
    block_factors_skipped,
    check_inputs,
    run_blocks,
)
from comera_dist.models.config import ModelConfig
from comera_dist.models.factory import TensorizeSpec, make_output_head
from comera_dist.models.token_loss import token_cross_entropy


class MLMHead(nn.Module):
    """``decoder(LN(gelu(dense(h))))``: (B, T, C) -> (B, T, V)."""

    def __init__(self, cfg: ModelConfig, word: nn.Module):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        nn.init.normal_(self.dense.weight, std=cfg.init_std)
        nn.init.zeros_(self.dense.bias)
        self.decoder = make_output_head(word, tie=cfg.tie_word_embeddings, bias=True, init_std=cfg.init_std)

    def forward(self, h: Tensor) -> Tensor:
        return self.decoder(self.norm(F.gelu(self.dense(h))))  # (B, T, V)


class BertMLM(nn.Module):
    """Embeddings -> ``num_layers`` post-LN blocks -> MLM head. Labels use -100 for unmasked tokens."""

    def __init__(self, cfg: ModelConfig, spec: TensorizeSpec | None = None):
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg, spec)
        self.blocks = nn.ModuleList(PostLNBlock(cfg, spec) for _ in range(cfg.num_layers))
        self.head = MLMHead(cfg, self.embeddings.word)  # decoder tied to the word table (dense or TTM)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None,
                token_type_ids: Tensor | None = None, mlm_positions: Tensor | None = None) -> dict[str, Tensor | None]:
        """input_ids, attention_mask, labels: (B, T). Returns loss (scalar or None), logits (B, T, V) and
        rank_penalty (R of ``compression.penalty.rank_penalty`` from the forward's own masks; None for a
        dense model and under ZeRO-3, see ``layers.group.shared_factors_and_penalty``).

        ``mlm_positions`` (B, P) (the MLM collator's): the head and the loss run at those positions
        only, and logits are (B, P, V), aligned with ``labels.gather(1, mlm_positions)``.
        """
        keep = check_inputs(self.config, input_ids, attention_mask)
        # every TT linear's L/R (same-shape layers contracted together; with model.recompute_factors each
        # recomputed block contracts its own) and the rank penalty R from the same masks
        factors, penalty = shared_factors_and_penalty(self, skip=block_factors_skipped(self))
        x = self.embeddings(input_ids, token_type_ids)  # (B, T, C)
        x = run_blocks(self, x, keep, factors)  # (B, T, C)
        if mlm_positions is not None:
            if mlm_positions.dim() != 2 or mlm_positions.shape[0] != input_ids.shape[0]:
                raise ValueError(f"mlm_positions must be (batch, P) = ({input_ids.shape[0]}, P), "
                                 f"got shape {tuple(mlm_positions.shape)}")
            x = x.gather(1, mlm_positions.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # (B, P, C)
            labels = None if labels is None else labels.gather(1, mlm_positions)  # (B, P)
        logits = self.head(x)  # (B, T or P, V)
        loss = None
        if labels is not None:
            loss = token_cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return {"loss": loss, "logits": logits, "rank_penalty": penalty}
