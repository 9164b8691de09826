"""``build_model``: the one constructor the engine, CLI and tests call for every arch."""

from __future__ import annotations

from typing import Any

from torch import nn

from comera_dist.layers import TTEmbedding, TTLinear
from comera_dist.models.bert_mlm import BertMLM
from comera_dist.models.config import ModelConfig
from comera_dist.models.factory import TensorizeSpec, check_modes_used
from comera_dist.models.gpt import GPT
from comera_dist.models.six_encoder import SixEncoderClassifier

_ARCH_CLASSES: dict[str, type[nn.Module]] = {
    "bert_mlm": BertMLM,
    "six_encoder_cls": SixEncoderClassifier,
    "gpt": GPT,
}


def resolve_spec(tensorize: Any) -> TensorizeSpec | None:
    """Accept ``comera.tensorize`` (a ``TensorizeSpec``), the whole ``comera`` section, or None.

    A whole section with ``enabled: false`` means the dense baseline (None).
    """
    if tensorize is None:
        return None
    if hasattr(tensorize, "tensorize") and hasattr(tensorize, "enabled"):
        return tensorize.tensorize if tensorize.enabled else None
    missing = [k for k in TensorizeSpec.__annotations__ if not hasattr(tensorize, k)]
    if missing:
        raise TypeError(f"tensorize settings {type(tensorize).__name__} lack {missing} "
                        "(pass comera.tensorize, the comera section, or None)")
    return tensorize


def build_model(model_cfg: ModelConfig, tensorize: Any = None) -> nn.Module:
    """The ``model_cfg.arch`` model, dense or tensorized per kind by ``tensorize``.

    ``forward(input_ids (B, T), attention_mask=None, labels=None) -> {"loss", "logits"}``.
    """
    if not isinstance(model_cfg, ModelConfig):
        raise TypeError(f"model_cfg must be a ModelConfig, got {type(model_cfg).__name__}")
    spec = resolve_spec(tensorize)
    model = _ARCH_CLASSES[model_cfg.arch](model_cfg, spec)
    check_modes_used(spec, tt_shapes_by_kind(model))
    return model


def tt_shapes_by_kind(model: nn.Module) -> dict[str, set[tuple[int, int]]]:
    """kind -> set of (in, out) of the TT linear layers of one of our models (from module names)."""
    shapes: dict[str, set[tuple[int, int]]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, TTLinear):
            kind = _kind_of(name)
            shapes.setdefault(kind, set()).add((mod.in_features, mod.out_features))
    return shapes


def _kind_of(name: str) -> str:
    """Layer kind from a module name of our models (``blocks.N.ffn.inp`` etc.; the rest is attention)."""
    if name.endswith("ffn.inp"):
        return "ffn_in"
    if name.endswith("ffn.out"):
        return "ffn_out"
    return "attention"


def tensorized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Dotted name -> every ``TTLinear``/``TTEmbedding`` inside ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (TTLinear, TTEmbedding))}


def count_params(module: nn.Module) -> int:
    """Parameter elements of ``module``; a tied tensor counts once (``parameters()`` deduplicates)."""
    return sum(p.numel() for p in module.parameters())
