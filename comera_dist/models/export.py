"""Dense export: our models and tensorized HF models -> a standard ``transformers`` model on disk.

``export_dense(model, out_dir)`` densifies every TT layer (``to_linear`` / ``to_embedding``)
and calls ``save_pretrained``; ``AutoModelFor...from_pretrained(out_dir)`` then gives the
same logits. Our archs map one to one onto HF classes:
``bert_mlm -> BertForMaskedLM``, ``six_encoder_cls -> BertForSequenceClassification``,
``gpt -> GPT2LMHeadModel`` (Q, K, V concatenated into ``c_attn``, weights transposed for ``Conv1D``).
A head tied to the word table (dense, or a ``TiedTTHead`` on a TTM table) exports as a standard tied
model (``tie_word_embeddings=True``, one densified table).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    PreTrainedModel,
)

from comera_dist.layers import TiedTTHead, TTEmbedding, TTLinear
from comera_dist.models.atomic import atomic_dir
from comera_dist.models.bert_mlm import BertMLM
from comera_dist.models.config import ModelConfig
from comera_dist.models.gpt import GPT
from comera_dist.models.hf import densify
from comera_dist.models.six_encoder import SixEncoderClassifier


def export_dense(model: nn.Module, out_dir: str | Path, *, token_ids: Mapping[str, int | None] | None = None) -> Path:
    """Densify ``model`` (ours or a tensorized HF model) and ``save_pretrained`` it to ``out_dir``.

    ``token_ids`` (ours): the run tokenizer's ``bos_token_id``, ``eos_token_id`` and ``pad_token_id``, for the
    exported config and generation config (GPT-2's defaults, 50256, are outside a run's vocabulary)."""
    hf = densify(model) if isinstance(model, PreTrainedModel) else to_hf(model, token_ids=token_ids)
    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        hf.save_pretrained(tmp)
    return out


def to_hf(model: nn.Module, *, token_ids: Mapping[str, int | None] | None = None) -> PreTrainedModel:
    """The dense HF model equivalent to one of our models (same logits in eval mode); ``token_ids`` as for
    ``export_dense`` (without them a GPT-2 export names no bos/eos token)."""
    if not isinstance(model, (BertMLM, SixEncoderClassifier, GPT)):
        raise TypeError(f"to_hf supports BertMLM, SixEncoderClassifier and GPT, got {type(model).__name__}")
    cfg: ModelConfig = model.config
    if isinstance(model, BertMLM):
        hf = BertForMaskedLM(_bert_config(cfg, tied=_tied(model.head.decoder, model.embeddings.word)))
        state = _bert_trunk(model, "bert.")
        state.update(_linear(model.head.dense, "cls.predictions.transform.dense."))
        state.update(_norm(model.head.norm, "cls.predictions.transform.LayerNorm."))
        state["cls.predictions.decoder.weight"] = _head_weight(model.head.decoder)
        state["cls.predictions.decoder.bias"] = model.head.decoder.bias
        state["cls.predictions.bias"] = model.head.decoder.bias
    elif isinstance(model, SixEncoderClassifier):
        hf = BertForSequenceClassification(_bert_config(cfg, tied=False))
        state = _bert_trunk(model, "bert.")
        state.update(_linear(model.pooler, "bert.pooler.dense."))
        state.update(_linear(model.classifier, "classifier."))
    else:
        hf = GPT2LMHeadModel(_gpt2_config(cfg, tied=_tied(model.lm_head, model.word), token_ids=token_ids or {}))
        state = _gpt2_state(model)
    _load_exact(hf, state)
    return hf.to(_dtype_of(model)).eval()


def _tied(head: nn.Module, word: nn.Module) -> bool:
    """Whether the head is the word table: a shared dense weight, or a ``TiedTTHead`` on this TTM table."""
    if isinstance(head, TiedTTHead):
        return head.embedding is word
    return isinstance(word, nn.Embedding) and head.weight is word.weight


def _head_weight(head: nn.Module) -> Tensor:
    """The head's dense ``(V, C)`` weight (a ``TiedTTHead``'s is its embedding's masked table)."""
    return head.dense_weight() if isinstance(head, TiedTTHead) else head.weight


def _bert_config(cfg: ModelConfig, *, tied: bool) -> BertConfig:
    return BertConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                      num_attention_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size,
                      hidden_act="gelu", hidden_dropout_prob=cfg.dropout, attention_probs_dropout_prob=cfg.dropout,
                      max_position_embeddings=cfg.max_positions, type_vocab_size=max(1, cfg.type_vocab_size),
                      layer_norm_eps=cfg.layer_norm_eps, initializer_range=cfg.init_std, num_labels=cfg.num_labels,
                      tie_word_embeddings=tied)


def _gpt2_config(cfg: ModelConfig, *, tied: bool, token_ids: Mapping[str, int | None]) -> GPT2Config:
    return GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.max_positions, n_embd=cfg.hidden_size,
                      n_layer=cfg.num_layers, n_head=cfg.num_heads, n_inner=cfg.intermediate_size,
                      activation_function="gelu", resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout,
                      attn_pdrop=cfg.dropout, layer_norm_epsilon=cfg.layer_norm_eps,
                      initializer_range=cfg.init_std, tie_word_embeddings=tied,
                      bos_token_id=token_ids.get("bos_token_id"), eos_token_id=token_ids.get("eos_token_id"),
                      pad_token_id=token_ids.get("pad_token_id"))


def _bert_trunk(model: BertMLM | SixEncoderClassifier, p: str) -> dict[str, Tensor]:
    emb = model.embeddings
    cfg = model.config
    state = {f"{p}embeddings.word_embeddings.weight": _table(emb.word),
             f"{p}embeddings.position_embeddings.weight": emb.position.weight,
             # No token types in our config: HF needs one row; zeros add nothing.
             f"{p}embeddings.token_type_embeddings.weight": (
                 emb.token_type.weight if emb.token_type is not None
                 else torch.zeros(1, cfg.hidden_size, dtype=emb.position.weight.dtype))}
    state.update(_norm(emb.norm, f"{p}embeddings.LayerNorm."))
    for i, blk in enumerate(model.blocks):
        q = f"{p}encoder.layer.{i}."
        state.update(_linear(blk.attn.query, q + "attention.self.query."))
        state.update(_linear(blk.attn.key, q + "attention.self.key."))
        state.update(_linear(blk.attn.value, q + "attention.self.value."))
        state.update(_linear(blk.attn.out, q + "attention.output.dense."))
        state.update(_norm(blk.attn_norm, q + "attention.output.LayerNorm."))
        state.update(_linear(blk.ffn.inp, q + "intermediate.dense."))
        state.update(_linear(blk.ffn.out, q + "output.dense."))
        state.update(_norm(blk.ffn_norm, q + "output.LayerNorm."))
    return state


def _gpt2_state(model: GPT) -> dict[str, Tensor]:
    state = {"transformer.wte.weight": _table(model.word), "transformer.wpe.weight": model.position.weight,
             "lm_head.weight": _head_weight(model.lm_head)}
    state.update(_norm(model.norm, "transformer.ln_f."))
    for i, blk in enumerate(model.blocks):
        q = f"transformer.h.{i}."
        qkv = [_dense(m) for m in (blk.attn.query, blk.attn.key, blk.attn.value)]
        state[q + "attn.c_attn.weight"] = torch.cat([lin.weight for lin in qkv], 0).t()  # (C, 3C) Conv1D
        state[q + "attn.c_attn.bias"] = torch.cat([lin.bias for lin in qkv])  # (3C,)
        for mod, name in ((blk.attn.out, "attn.c_proj"), (blk.ffn.inp, "mlp.c_fc"), (blk.ffn.out, "mlp.c_proj")):
            lin = _dense(mod)
            state[q + name + ".weight"] = lin.weight.t()  # (in, out) Conv1D
            state[q + name + ".bias"] = lin.bias
        state.update(_norm(blk.attn_norm, q + "ln_1."))
        state.update(_norm(blk.ffn_norm, q + "ln_2."))
    return state


def _dense(mod: nn.Module) -> nn.Linear:
    return mod.to_linear() if isinstance(mod, TTLinear) else mod


def _linear(mod: nn.Module, prefix: str) -> dict[str, Tensor]:
    lin = _dense(mod)
    return {prefix + "weight": lin.weight, prefix + "bias": lin.bias}


def _norm(mod: nn.LayerNorm, prefix: str) -> dict[str, Tensor]:
    return {prefix + "weight": mod.weight, prefix + "bias": mod.bias}


def _table(mod: nn.Module) -> Tensor:
    return mod.to_embedding().weight if isinstance(mod, TTEmbedding) else mod.weight


def _dtype_of(model: nn.Module) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


@torch.no_grad()
def _load_exact(hf: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy ``state`` into ``hf``: every HF parameter must be covered, shapes must match."""
    params = dict(hf.named_parameters(remove_duplicate=False))
    missing = sorted(set(params) - set(state))
    unknown = sorted(set(state) - set(params))
    if missing or unknown:
        raise KeyError(f"export key map mismatch for {type(hf).__name__}: missing {missing}, unknown {unknown}")
    for name, value in state.items():
        if tuple(params[name].shape) != tuple(value.shape):
            raise ValueError(f"export: {name} expects shape {tuple(params[name].shape)}, got {tuple(value.shape)}")
    hf.to(next(iter(state.values())).dtype)
    params = dict(hf.named_parameters(remove_duplicate=False))
    for name, value in state.items():
        params[name].copy_(value.detach())
