"""The paper's six-encoder classifier (CoMERA section 6 / MNLI): post-LN encoder, [CLS] pooler, linear head.

Paper sizes: d=768, 12 heads, FFN 3072, vocab 30522, sequences of 128 tokens,
6 blocks (``models.presets.six_encoder_paper``). The pooler is a ``d x d``
projection exactly like Q/K/V/out, so it is built as an "attention"-kind layer:
tensorized with the attention flag and modes. That choice is what the paper's
whole-model figure (about 1.49 M TT vs 66.96 M dense) counts; see
``tests/unit/test_models_sizes.py`` for the arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from comera_dist.layers.group import project, shared_factors_and_penalty
from comera_dist.models.blocks import (
    BertEmbeddings,
    PostLNBlock,
    block_factors_skipped,
    check_inputs,
    run_blocks,
)
from comera_dist.models.config import ModelConfig
from comera_dist.models.cpu_dropout import Dropout
from comera_dist.models.factory import TensorizeSpec, make_linear


class SixEncoderClassifier(nn.Module):
    """Embeddings -> ``num_layers`` post-LN blocks -> tanh pooler on token 0 -> ``num_labels`` logits."""

    def __init__(self, cfg: ModelConfig, spec: TensorizeSpec | None = None):
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg, spec)
        self.blocks = nn.ModuleList(PostLNBlock(cfg, spec) for _ in range(cfg.num_layers))
        self.pooler = make_linear(spec, "attention", cfg.hidden_size, cfg.hidden_size, init_std=cfg.init_std)
        self.drop = Dropout(cfg.dropout)
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels)
        nn.init.normal_(self.classifier.weight, std=cfg.init_std)
        nn.init.zeros_(self.classifier.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, labels: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> dict[str, Tensor | None]:
        """input_ids, attention_mask: (B, T); labels: (B,) class ids. Returns loss, logits (B, num_labels) and
        rank_penalty (R of ``compression.penalty.rank_penalty``, None for a dense model)."""
        keep = check_inputs(self.config, input_ids, attention_mask)
        # every TT linear's L/R (same-shape layers contracted together; with model.recompute_factors each
        # recomputed block contracts its own) and the rank penalty R from the same masks
        factors, penalty = shared_factors_and_penalty(self, skip=block_factors_skipped(self))
        x = self.embeddings(input_ids, token_type_ids)  # (B, T, C)
        x = run_blocks(self, x, keep, factors)  # (B, T, C)
        pooled = torch.tanh(project(self.pooler, x[:, 0], factors))  # (B, C) from the first ([CLS]) token
        logits = self.classifier(self.drop(pooled))  # (B, num_labels)
        loss = None
        if labels is not None:
            if labels.shape != logits.shape[:1]:
                raise ValueError(f"labels must be (batch,) class ids, got shape {tuple(labels.shape)}")
            loss = F.cross_entropy(logits.float(), labels)
        return {"loss": loss, "logits": logits, "rank_penalty": penalty}
