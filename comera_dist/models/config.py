"""The ``model:`` config section: architecture and sizes of the models in ``comera_dist.models``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ARCHS: tuple[str, ...] = ("bert_mlm", "six_encoder_cls", "gpt")


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Sizes of one transformer; the arch fixes the block layout (see each model file)."""

    arch: Literal["bert_mlm", "six_encoder_cls", "gpt"] = "bert_mlm"
    """``bert_mlm``: post-LN BERT-like encoder with an MLM head (CodeBERT-like);
    ``six_encoder_cls``: the paper's post-LN encoder classifier (pooler + linear head);
    ``gpt``: pre-LN GPT-like causal decoder with an LM head."""
    vocab_size: int = 30522
    """Rows of the word-embedding table (at least the tokenizer's vocabulary size; extra rows go unused)."""
    hidden_size: int = 768
    """Model width ``d`` (divisible by ``num_heads``)."""
    num_layers: int = 6
    """Transformer blocks."""
    num_heads: int = 12
    """Attention heads per block."""
    intermediate_size: int = 3072
    """Width of the feed-forward block (GELU)."""
    max_positions: int = 512
    """Rows of the learned position table: the longest sequence the model accepts."""
    type_vocab_size: int = 2
    """Token-type (segment) rows of the BERT-like embeddings (0: none; ignored by ``gpt``)."""
    dropout: float = 0.1
    """Dropout on embeddings, attention probabilities and residual branches, in [0, 1)."""
    num_labels: int = 2
    """Classes of ``six_encoder_cls`` (ignored by the other archs)."""
    layer_norm_eps: float = 1e-12
    """LayerNorm epsilon (BERT uses 1e-12, GPT-2 1e-5)."""
    init_std: float = 0.02
    """Standard deviation of the normal init of dense weights and tables."""
    tie_word_embeddings: bool = True
    """Tie the MLM decoder / LM head to the word embedding (``bert_mlm``, ``gpt``): a dense head shares
    a dense table's weight; with a TTM embedding the head (``layers.TiedTTHead``) computes ``h E^T``
    from the embedding's cores and gates, so the whole model has no dense ``V x C`` matrix left.
    False: the head is its own dense ``Linear``."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of keeping them (``torch.utils.checkpoint``,
    non-reentrant; dropout replays the same masks): a block keeps only its input until backward, for
    about one more forward of compute. What bounds a compressed model's memory at small batches, where
    the TT factors are a few MiB and the activations most of the rest (``models.blocks.run_blocks``)."""
    recompute_factors: bool = False
    """With ``activation_checkpointing``: each recomputed block also contracts its own layers' TT factors
    ``L``/``R`` inside its checkpoint, so they are remade with it, instead of the model contracting all layers
    at once and keeping every block's factors from the forward to the end of backward. Less memory, more small
    ops: on the CPU, the six-encoder's recomputing batch-1 step peaked at 31.1 MiB instead of 49.6 (the
    factors, their stacked cores and their gradients), with 5,714 aten ops instead of 2,589
    (``docs/bench/notes/six-encoder-recompute-factors-cpu.md``). Needs ``activation_checkpointing``. Changes
    nothing under ZeRO-3 (each layer contracts its own factors in its own forward there) or for a dense model
    (no factors)."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"model.arch must be one of {list(ARCHS)}, got {self.arch!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                     "max_positions"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"model.{name} must be >= 1, got {value}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size ({self.hidden_size}) must be divisible by "
                             f"model.num_heads ({self.num_heads})")
        if self.type_vocab_size < 0:
            raise ValueError(f"model.type_vocab_size must be >= 0, got {self.type_vocab_size}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.num_labels < 1:
            raise ValueError(f"model.num_labels must be >= 1, got {self.num_labels}")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"model.layer_norm_eps must be > 0, got {self.layer_norm_eps}")
        if not self.init_std > 0:
            raise ValueError(f"model.init_std must be > 0, got {self.init_std}")
        if self.recompute_factors and not self.activation_checkpointing:
            raise ValueError("model.recompute_factors needs model.activation_checkpointing: true (the factors are "
                             "remade with each recomputed block)")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads
