"""The compact TT form on disk: ``save_tt(model, dir)`` / ``load_tt(dir)``.

``dir/tt_config.json`` records how to rebuild the module tree: the model config (ours:
``ModelConfig``; HF: class name + ``config.to_dict()``) and, for every TT layer, its
dotted name, type and ``tensor_shapes()`` (modes and *physical* ranks, so a pruned
model rebuilds with its pruned shapes); a ``TiedTTHead`` records the name of the table it reads. ``dir/model.safetensors`` holds the state
dict (cores, gates, tau, dense leftovers; tied tensors stored once). Loading builds the
dense skeleton, swaps in TT layers of the recorded shapes, then loads strictly.

Version 2 stores each layer's cores as one flat ``<layer>.core`` (the layer's ``core_shapes()``,
from the recorded modes and ranks, cut it back into cores) and its gates as one ``<layer>.gate``;
version 1 stored ``<layer>.cores.<k>`` and ``<layer>.gates.<k>``, which ``TensorizedModule``'s
``load_state_dict`` still reads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_model, save_model
from torch import nn

from comera_dist.configbase import from_dict, to_dict
from comera_dist.layers import TiedTTHead, TTEmbedding, TTLinear
from comera_dist.models.atomic import atomic_dir
from comera_dist.models.build import build_model
from comera_dist.models.config import ModelConfig
from comera_dist.models.hf import ARCH_MAPS, FusedQKV, tie_tt_head

FORMAT = "comera-tt"
VERSION = 2
READABLE = (1, 2)
CONFIG_FILE = "tt_config.json"
WEIGHTS_FILE = "model.safetensors"


def save_tt(model: nn.Module, out_dir: str | Path) -> Path:
    """Write ``model`` (one of ours, or a tensorized HF model) in compact TT form to ``out_dir``."""
    out = Path(out_dir)
    if isinstance(getattr(model, "config", None), ModelConfig):
        source: dict[str, Any] = {"kind": "comera", "model_config": to_dict(model.config)}
    elif type(model).__name__ in ARCH_MAPS:
        source = {"kind": "hf", "class": type(model).__name__, "hf_config": model.config.to_dict()}
    else:
        raise TypeError(f"save_tt supports our models and {sorted(ARCH_MAPS)}, got {type(model).__name__}")
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    meta = {"format": FORMAT, "version": VERSION, "dtype": str(dtype).removeprefix("torch."), **source,
            "modules": _describe(model)}
    with atomic_dir(out) as tmp:
        (tmp / CONFIG_FILE).write_text(json.dumps(meta, indent=2))
        save_model(model, str(tmp / WEIGHTS_FILE))
    return out


def load_tt(path: str | Path, map_location: str | torch.device = "cpu") -> nn.Module:
    """Rebuild the model saved by ``save_tt`` with its recorded (possibly pruned) TT shapes."""
    path = Path(path)
    cfg_file, weights = path / CONFIG_FILE, path / WEIGHTS_FILE
    for f in (cfg_file, weights):
        if not f.is_file():
            raise FileNotFoundError(f"load_tt: {f} not found (is {path} a save_tt directory?)")
    try:
        meta = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"load_tt: {cfg_file} is not valid JSON: {e}") from e
    if meta.get("format") != FORMAT or meta.get("version") not in READABLE:
        raise ValueError(f"load_tt: {cfg_file} has format {meta.get('format')!r} version {meta.get('version')!r}, "
                         f"expected {FORMAT!r} version {' or '.join(map(str, READABLE))}")
    dtype = getattr(torch, meta["dtype"])
    if meta["kind"] == "comera":
        model = build_model(from_dict(ModelConfig, meta["model_config"], "model_config"), None)
    elif meta["kind"] == "hf" and meta["class"] in ARCH_MAPS:
        cls = getattr(transformers, meta["class"])
        model = cls(cls.config_class.from_dict(meta["hf_config"]))
    else:
        raise ValueError(f"load_tt: {cfg_file} has unknown model kind {meta.get('kind')!r}/{meta.get('class')!r}")
    model.to(dtype)
    tied = {n: d for n, d in meta["modules"].items() if d.get("type") == "TiedTTHead"}
    for name, desc in sorted(meta["modules"].items(), key=lambda kv: kv[0].count(".")):
        if name not in tied:
            model.set_submodule(name, _rebuild(name, desc, dtype))
    for name, desc in tied.items():  # after the TTM tables they read
        if meta["kind"] == "hf":
            tie_tt_head(model)
        else:
            model.set_submodule(name, TiedTTHead(model.get_submodule(desc["embedding"]), bias=desc["bias"]))
    if hasattr(model, "all_tied_weights_keys"):  # untied by tensorize: do not re-tie on our behalf
        model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=True)
    missing, unexpected = load_model(model, str(weights), strict=False, device=str(map_location))
    if missing or unexpected:
        raise ValueError(f"load_tt: {weights} does not match the recorded model: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")
    return model.to(map_location).eval()


def _describe(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Dotted name -> how to rebuild every TT layer (and GPT-2 ``FusedQKV`` wrapper)."""
    out: dict[str, dict[str, Any]] = {}
    names = {id(m): n for n, m in model.named_modules()}
    for name, mod in model.named_modules():
        if isinstance(mod, TTLinear):
            out[name] = {"type": "TTLinear", "in_features": mod.in_features, "out_features": mod.out_features,
                         "bias": mod.bias is not None, **mod.tensor_shapes()}
        elif isinstance(mod, TTEmbedding):
            out[name] = {"type": "TTEmbedding", "num_embeddings": mod.num_embeddings,
                         "embedding_dim": mod.embedding_dim, "padding_idx": mod.padding_idx, **mod.tensor_shapes()}
        elif isinstance(mod, FusedQKV):
            out[name] = {"type": "FusedQKV"}
        elif isinstance(mod, TiedTTHead):
            out[name] = {"type": "TiedTTHead", "embedding": names[id(mod.embedding)], "bias": mod.bias is not None}
    return out


def _rebuild(name: str, desc: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    kind = desc.get("type")
    if kind == "TTLinear":
        return TTLinear(desc["in_features"], desc["out_features"], in_modes=desc["in_modes"],
                        out_modes=desc["out_modes"], ranks=desc["ranks"], bias=desc["bias"], dtype=dtype)
    if kind == "TTEmbedding":
        return TTEmbedding(desc["num_embeddings"], desc["embedding_dim"], row_modes=desc["row_modes"],
                           col_modes=desc["col_modes"], ranks=desc["ranks"], padding_idx=desc["padding_idx"],
                           dtype=dtype)
    if kind == "FusedQKV":  # placeholders; its q/k/v TT layers are recorded (and rebuilt) on their own
        return FusedQKV(nn.Identity(), nn.Identity(), nn.Identity())
    raise ValueError(f"load_tt: module {name!r} has unknown type {kind!r}")
