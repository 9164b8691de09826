"""The paper's reference model settings (CoMERA section 6) as Python values, for tests and configs."""

from __future__ import annotations

from comera_dist.models.config import ModelConfig

PAPER_MODES: dict[str, list[list[int]]] = {
    "embedding": [[16, 20, 10, 10], [4, 4, 8, 6]],  # 32000 >= 30522 rows, 768 columns
    "attention": [[12, 8, 8], [8, 8, 12]],  # 768 x 768
    "ffn_in": [[12, 8, 8], [12, 16, 16]],  # 768 x 3072
    "ffn_out": [[16, 16, 12], [8, 8, 12]],  # 3072 x 768
}
"""The factorizations of the paper's six-encoder (``comera.tensorize.modes``)."""
PAPER_MAX_RANK = 30
"""TT rank bound of the linear layers."""
PAPER_EMBEDDING_MAX_RANK = 32
"""TTM rank bound of the embedding."""


def six_encoder_paper(*, max_positions: int = 512, num_labels: int = 3) -> ModelConfig:
    """The six-encoder classifier: d=768, 12 heads, FFN 3072, vocab 30522, 6 post-LN blocks.

    Trained on sequences of 128 tokens; ``max_positions`` is the size of the (dense) position
    table. The paper's whole-model counts (about 1.49 M TT / 66.96 M dense) come out with BERT's
    512-row table and 3 MNLI labels (see tests/unit/test_models_sizes.py).
    """
    return ModelConfig(arch="six_encoder_cls", vocab_size=30522, hidden_size=768, num_layers=6, num_heads=12,
                       intermediate_size=3072, max_positions=max_positions, type_vocab_size=2, dropout=0.1,
                       num_labels=num_labels, layer_norm_eps=1e-12)
