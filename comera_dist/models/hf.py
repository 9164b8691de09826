"""HuggingFace ``transformers`` models to TT form and back: explicit key maps plus shape asserts.

Supported: ``BertForMaskedLM``, ``BertForSequenceClassification``, ``GPT2LMHeadModel`` and
``LlamaForCausalLM``. Each architecture has a key map (which dotted module is which
layer kind), and every mapped module is checked for its type and for the shape the
HF config implies before it is replaced; nothing is found by guessing names.

- ``tensorize(hf_model, spec, init="svd")``: pretrained dense weights -> TT-SVD at ``spec.max_rank``
  (exact when the rank bound reaches the full TT ranks: use ``max_rank = embedding_max_rank =
  factory.FULL_RANK``); ``init="random"``: fresh Gaussian cores (pretraining from scratch). Biases
  stay dense and are copied.
- GPT-2 stores ``Conv1D`` weights as ``(in, out)`` and fuses Q, K, V into one ``c_attn``; it becomes
  ``FusedQKV`` (three TT layers, outputs concatenated) so Q, K, V are tensorized like the paper's.
- Tied embeddings stay tied: tensorizing the embedding of a tied model replaces the LM head by a
  ``TiedTTHead`` on the new ``TTEmbedding`` (``logits = h E^T`` from the same cores and gates; BERT's
  decoder keeps sharing ``cls.predictions.bias``). ``config.tie_word_embeddings`` stays True; the
  instance's ``_tied_weights_keys`` drops the weight entry (the tie is structural, there is no head
  weight for HF to re-tie), so ``tie_weights()`` leaves the TT table alone. ``densify`` restores a
  standard weight-tied model.
- ``densify(hf_model)`` (used by ``export_dense``) replaces every TT layer by the dense module type
  the architecture expects (``nn.Linear``, ``Conv1D``, ``nn.Embedding``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from comera_dist.layers import TiedTTHead, TTEmbedding, TTLinear
from comera_dist.models.factory import (
    TensorizeSpec,
    check_modes_used,
    explicit_modes,
    is_tensorized,
    tt_from_embedding,
    tt_from_linear,
)


class FusedQKV(nn.Module):
    """GPT-2's fused ``c_attn`` as three projections: ``x (..., C) -> cat(q, k, v) (..., 3C)``."""

    def __init__(self, q: nn.Module, k: nn.Module, v: nn.Module):
        super().__init__()
        self.q, self.k, self.v = q, k, v

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)  # (..., 3C)


@dataclass(frozen=True)
class ArchMap:
    """Where the tensorizable layers of one HF architecture live and what shapes they must have."""

    embedding: str
    """Dotted name of the word-embedding module."""
    layers: str
    """Dotted name of the ``ModuleList`` of transformer blocks."""
    per_layer: dict[str, tuple[str, ...]]
    """kind -> names inside one block (``"attention"``, ``"ffn_in"``, ``"ffn_out"``)."""
    shapes: Callable[[Any], dict[str, tuple[int, int]]]
    """HF config -> ``{name inside a block: (in_features, out_features)}``."""
    conv1d: bool = False
    """Weights are ``Conv1D`` ``(in, out)`` (GPT-2) rather than ``nn.Linear`` ``(out, in)``."""
    fused_qkv: str | None = None
    """Name of a fused Q/K/V projection inside a block (GPT-2 ``attn.c_attn``)."""
    head: str | None = None
    """Dotted name of the LM head that may be tied to the embedding."""
    extra: dict[str, str] = field(default_factory=dict)
    """Whole-model (not per-block) layers: dotted name -> kind."""


def _bert_shapes(c: Any) -> dict[str, tuple[int, int]]:
    h, i = c.hidden_size, c.intermediate_size
    return {"attention.self.query": (h, h), "attention.self.key": (h, h), "attention.self.value": (h, h),
            "attention.output.dense": (h, h), "intermediate.dense": (h, i), "output.dense": (i, h)}


def _gpt2_shapes(c: Any) -> dict[str, tuple[int, int]]:
    h = c.n_embd
    i = c.n_inner or 4 * h
    return {"attn.c_attn": (h, 3 * h), "attn.c_proj": (h, h), "mlp.c_fc": (h, i), "mlp.c_proj": (i, h)}


def _llama_shapes(c: Any) -> dict[str, tuple[int, int]]:
    h, i = c.hidden_size, c.intermediate_size
    hd = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    return {"self_attn.q_proj": (h, q), "self_attn.k_proj": (h, kv), "self_attn.v_proj": (h, kv),
            "self_attn.o_proj": (q, h), "mlp.gate_proj": (h, i), "mlp.up_proj": (h, i), "mlp.down_proj": (i, h)}


_BERT_KINDS = {"attention": ("attention.self.query", "attention.self.key", "attention.self.value",
                             "attention.output.dense"),
               "ffn_in": ("intermediate.dense",), "ffn_out": ("output.dense",)}

ARCH_MAPS: dict[str, ArchMap] = {
    "BertForMaskedLM": ArchMap(embedding="bert.embeddings.word_embeddings", layers="bert.encoder.layer",
                               per_layer=_BERT_KINDS, shapes=_bert_shapes, head="cls.predictions.decoder"),
    "BertForSequenceClassification": ArchMap(embedding="bert.embeddings.word_embeddings",
                                             layers="bert.encoder.layer", per_layer=_BERT_KINDS,
                                             shapes=_bert_shapes, extra={"bert.pooler.dense": "attention"}),
    "GPT2LMHeadModel": ArchMap(embedding="transformer.wte", layers="transformer.h",
                               per_layer={"attention": ("attn.c_attn", "attn.c_proj"), "ffn_in": ("mlp.c_fc",),
                                          "ffn_out": ("mlp.c_proj",)},
                               shapes=_gpt2_shapes, conv1d=True, fused_qkv="attn.c_attn", head="lm_head"),
    "LlamaForCausalLM": ArchMap(embedding="model.embed_tokens", layers="model.layers",
                                per_layer={"attention": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                         "self_attn.o_proj"),
                                           "ffn_in": ("mlp.gate_proj", "mlp.up_proj"),
                                           "ffn_out": ("mlp.down_proj",)},
                                shapes=_llama_shapes, head="lm_head"),
}


def arch_map(hf_model: nn.Module) -> ArchMap:
    """The key map of ``hf_model``'s class; other classes are a clear error."""
    name = type(hf_model).__name__
    if name not in ARCH_MAPS:
        raise ValueError(f"tensorize supports {sorted(ARCH_MAPS)}, got {name}")
    return ARCH_MAPS[name]


def mapped_layers(hf_model: nn.Module) -> list[tuple[str, str, tuple[int, int]]]:
    """``(dotted name, kind, (in, out))`` of every tensorizable linear layer, shapes from the config."""
    amap = arch_map(hf_model)
    blocks = hf_model.get_submodule(amap.layers)
    expect = amap.shapes(hf_model.config)
    out = []
    for i in range(len(blocks)):
        for kind, names in amap.per_layer.items():
            out.extend((f"{amap.layers}.{i}.{n}", kind, expect[n]) for n in names)
    h = hf_model.config.hidden_size
    out.extend((name, kind, (h, h)) for name, kind in amap.extra.items())
    return out


def tensorize(hf_model: nn.Module, spec: TensorizeSpec, init: str = "svd") -> nn.Module:
    """Replace ``hf_model``'s embedding / attention / FFN modules by TT layers, in place; returns it.

    init: ``"svd"`` (TT-SVD of the current dense weights, truncated to ``spec.max_rank``) or
    ``"random"`` (Gaussian cores). Kinds switched off in ``spec`` stay dense.
    """
    if init not in ("svd", "random"):
        raise ValueError(f"init must be 'svd' or 'random', got {init!r}")
    amap = arch_map(hf_model)
    todo = [(name, kind, shape) for name, kind, shape in mapped_layers(hf_model) if is_tensorized(spec, kind)]
    # Check everything before replacing anything: a bad model or spec leaves hf_model untouched.
    shapes: dict[str, set[tuple[int, int]]] = {}
    for name, kind, (n_in, n_out) in todo:
        _check_dense(name, hf_model.get_submodule(name), n_in, n_out, amap.conv1d)
        fused = amap.fused_qkv is not None and name.endswith(amap.fused_qkv)
        shapes.setdefault(kind, set()).add((n_in, n_out // 3 if fused else n_out))
    check_modes_used(spec, shapes)
    if is_tensorized(spec, "embedding"):
        emb, c = hf_model.get_submodule(amap.embedding), hf_model.config
        if not isinstance(emb, nn.Embedding) or tuple(emb.weight.shape) != (c.vocab_size, c.hidden_size):
            raise ValueError(f"{amap.embedding}: expected nn.Embedding({c.vocab_size}, {c.hidden_size}) from the "
                             f"config, got {emb}")
        explicit_modes(spec, "embedding", c.vocab_size, c.hidden_size)  # raises on a bad override
    for name, kind, (_n_in, n_out) in todo:
        mod = hf_model.get_submodule(name)
        if amap.fused_qkv is not None and name.endswith(amap.fused_qkv):
            parts = [_linear_slice(mod, j * (n_out // 3), n_out // 3) for j in range(3)]
            new: nn.Module = FusedQKV(*(_to_tt(p, spec, kind, init) for p in parts))
        else:
            new = _to_tt(_as_linear(mod), spec, kind, init)
        hf_model.set_submodule(name, new)
    if is_tensorized(spec, "embedding"):
        _tensorize_embedding(hf_model, amap, spec, init)
    return hf_model


def _tensorize_embedding(hf_model: nn.Module, amap: ArchMap, spec: TensorizeSpec, init: str) -> None:
    emb = hf_model.get_submodule(amap.embedding)
    head = hf_model.get_submodule(amap.head) if amap.head is not None else None
    tied = head is not None and getattr(head, "weight", None) is emb.weight
    if init == "svd":
        tt = tt_from_embedding(emb, spec)
    else:
        row_modes, col_modes = explicit_modes(spec, "embedding", emb.num_embeddings, emb.embedding_dim)
        tt = TTEmbedding(emb.num_embeddings, emb.embedding_dim, row_modes=row_modes, col_modes=col_modes,
                         num_cores=spec.embedding_num_cores, max_rank=spec.embedding_max_rank)
    tt = tt.to(device=emb.weight.device, dtype=emb.weight.dtype)
    hf_model.set_submodule(amap.embedding, tt)
    if tied:
        tie_tt_head(hf_model)


def tie_tt_head(hf_model: nn.Module) -> TiedTTHead:
    """Replace the LM head of ``hf_model`` (whose embedding is a ``TTEmbedding``) by a ``TiedTTHead`` on it.

    The head's bias Parameter, if any, is kept (BERT shares it with ``cls.predictions.bias``). The
    weight tie is structural from then on, so the instance's ``_tied_weights_keys`` keeps only HF's
    other entries and ``tie_weights()`` never touches the TT table.
    """
    amap = arch_map(hf_model)
    emb = hf_model.get_submodule(amap.embedding)
    if amap.head is None or not isinstance(emb, TTEmbedding):
        raise ValueError(f"tie_tt_head needs an LM head and a TTEmbedding at {amap.embedding}, got "
                         f"{type(emb).__name__} (head {amap.head!r})")
    head = hf_model.get_submodule(amap.head)
    bias = getattr(head, "bias", None)
    new_head = TiedTTHead(emb, bias=bias is not None)
    if bias is not None:
        new_head.bias = bias  # the same Parameter
    hf_model.set_submodule(amap.head, new_head)
    hf_model._tied_weights_keys = {k: v for k, v in (type(hf_model)._tied_weights_keys or {}).items()
                                   if k != f"{amap.head}.weight"}
    if hasattr(hf_model, "all_tied_weights_keys"):
        hf_model.all_tied_weights_keys = hf_model.get_expanded_tied_weights_keys(all_submodels=True)
    return new_head


def _check_dense(name: str, mod: nn.Module, n_in: int, n_out: int, conv1d: bool) -> None:
    """Assert the module at ``name`` is the dense type and shape the key map expects."""
    if conv1d:
        ok = isinstance(mod, Conv1D) and tuple(mod.weight.shape) == (n_in, n_out)
        want = f"Conv1D weight (in={n_in}, out={n_out})"
    else:
        ok = isinstance(mod, nn.Linear) and tuple(mod.weight.shape) == (n_out, n_in)
        want = f"nn.Linear({n_in}, {n_out})"
    if not ok:
        got = f"{type(mod).__name__} weight {tuple(mod.weight.shape)}" if hasattr(mod, "weight") else repr(mod)
        raise ValueError(f"{name}: expected {want} from the config, got {got}")


def _as_linear(mod: nn.Module) -> nn.Linear:
    """``nn.Linear`` view of a dense projection (``Conv1D`` weights are transposed)."""
    if isinstance(mod, nn.Linear):
        return mod
    w = mod.weight.detach().t()  # Conv1D (in, out) -> Linear (out, in)
    lin = nn.Linear(w.shape[1], w.shape[0], bias=mod.bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if mod.bias is not None:
            lin.bias.copy_(mod.bias)
    return lin


def _linear_slice(mod: nn.Module, start: int, width: int) -> nn.Linear:
    """Output columns ``[start, start + width)`` of a dense projection as an ``nn.Linear``."""
    full = _as_linear(mod)
    lin = nn.Linear(full.in_features, width, bias=full.bias is not None, device=full.weight.device,
                    dtype=full.weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(full.weight[start:start + width])  # (width, in)
        if full.bias is not None:
            lin.bias.copy_(full.bias[start:start + width])
    return lin


def _to_tt(lin: nn.Linear, spec: TensorizeSpec, kind: str, init: str) -> TTLinear:
    if init == "svd":
        tt = tt_from_linear(lin, spec, kind)
    else:
        in_modes, out_modes = explicit_modes(spec, kind, lin.in_features, lin.out_features)
        tt = TTLinear(lin.in_features, lin.out_features, in_modes=in_modes, out_modes=out_modes,
                      num_cores=spec.num_cores, max_rank=spec.max_rank, bias=lin.bias is not None,
                      dtype=lin.weight.dtype, device=lin.weight.device)  # the bias copied without rounding
        if lin.bias is not None:
            with torch.no_grad():
                tt.bias.copy_(lin.bias)
    return tt.to(device=lin.weight.device, dtype=lin.weight.dtype)


def densify(hf_model: nn.Module) -> nn.Module:
    """A deep copy of a (partly) tensorized HF model with every TT layer made dense again."""
    amap = arch_map(hf_model)
    model = copy.deepcopy(hf_model)
    for name, _kind, (n_in, n_out) in mapped_layers(model):
        mod = model.get_submodule(name)
        if isinstance(mod, FusedQKV):
            lins = [_dense_linear(p) for p in (mod.q, mod.k, mod.v)]
            w = torch.cat([lin.weight for lin in lins], dim=0)  # (3C, C)
            b = torch.cat([lin.bias for lin in lins]) if lins[0].bias is not None else None
            model.set_submodule(name, _conv1d(w, b))
        elif isinstance(mod, TTLinear):
            lin = _dense_linear(mod)
            model.set_submodule(name, _conv1d(lin.weight, lin.bias) if amap.conv1d else lin)
        _check_dense(name, model.get_submodule(name), n_in, n_out, amap.conv1d)
    emb = model.get_submodule(amap.embedding)
    if isinstance(emb, TTEmbedding):
        model.set_submodule(amap.embedding, emb.to_embedding())
    head = model.get_submodule(amap.head) if amap.head is not None else None
    if isinstance(head, TiedTTHead):  # back to a standard weight tie
        assert amap.head is not None
        table = model.get_submodule(amap.embedding).weight  # (V, C)
        lin = nn.Linear(table.shape[1], table.shape[0], bias=head.bias is not None, device=table.device,
                        dtype=table.dtype)
        lin.weight = table
        if head.bias is not None:
            lin.bias = head.bias
        model.set_submodule(amap.head, lin)
        model.__dict__.pop("_tied_weights_keys", None)  # the class's full mapping again
        if hasattr(model, "all_tied_weights_keys"):
            model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=True)
    return model


def _dense_linear(mod: nn.Module) -> nn.Linear:
    return mod.to_linear() if isinstance(mod, TTLinear) else mod


def _conv1d(weight: Tensor, bias: Tensor | None) -> Conv1D:
    """A ``Conv1D`` holding ``nn.Linear``-layout ``weight`` (out, in) and ``bias`` (out,)."""
    conv = Conv1D(weight.shape[0], weight.shape[1]).to(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        conv.weight.copy_(weight.t())  # (in, out)
        if bias is not None:
            conv.bias.copy_(bias)
        else:
            conv.bias.zero_()
    return conv
