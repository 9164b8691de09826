"""The ``--dry-run`` summary of a run: parameter counts, compression, FLOPs per token, DeepSpeed JSON.

Builds the model on CPU exactly as the run would (TT layers never materialize their dense
matrices), reads the compression accounting, and resolves the DeepSpeed config for a world size.
Nothing is written and no process group is started.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from torch import nn

from comera_dist.compression.accounting import compression_report
from comera_dist.compression.groups import param_groups
from comera_dist.compression.pruning import PruningPlan, apply_plan
from comera_dist.config import RunConfig, resolved_dict
from comera_dist.configbase import ConfigError
from comera_dist.engine.config import solve_batch_sizes, to_deepspeed_dict
from comera_dist.engine.model_factory import build_run_model
from comera_dist.layers import TiedTTHead, TTEmbedding

KINDS = ("embedding", "attention", "ffn_in", "ffn_out", "other")
ENCODER_KINDS = ("attention", "ffn_in", "ffn_out")


def layer_kind(name: str, layer: nn.Module) -> str:
    """Kind of a tensorized layer of our models: the embedding table, or by module name
    (``blocks.N.ffn.inp`` / ``.ffn.out`` / ``.attn.*``); anything else (a pooler, a head) is ``other``."""
    if isinstance(layer, TTEmbedding):
        return "embedding"
    if name.endswith("ffn.inp"):
        return "ffn_in"
    if name.endswith("ffn.out"):
        return "ffn_out"
    return "attention" if ".attn." in name else "other"


def _linear_flops(model: nn.Module) -> int:
    """Forward FLOPs per token of the dense ``nn.Linear`` layers (heads, untensorized projections)."""
    return sum(2 * m.in_features * m.out_features for m in model.modules() if isinstance(m, nn.Linear))


def run_summary(cfg: RunConfig, *, world_size: int, plans: Sequence[str] = ()) -> dict[str, Any]:
    """Plain-data summary of ``cfg`` on ``world_size`` ranks (JSON-ready). ``plans``: the pruning plans of the
    checkpoint a resume would load (its meta's ``plans``, JSON): the sizes are then that checkpoint's shapes."""
    model = build_run_model(cfg)
    for i, text in enumerate(plans):
        try:
            apply_plan(model, PruningPlan.from_json(text))
        except (ValueError, TypeError) as e:  # the run's resume would fail on it too
            raise ConfigError(f"the checkpoint's pruning plan {i + 1} of {len(plans)} does not apply to this "
                              f"config's model: {e}") from None
    report = compression_report(model)
    modules = dict(model.named_modules())
    by_kind: dict[str, dict[str, Any]] = {}
    for name, row in report["layers"].items():
        kind = layer_kind(name, modules[name])
        row["layer_kind"] = kind
        entry = by_kind.setdefault(kind, {"count": 0, "active_params": 0, "dense_params": 0,
                                          "active_params_each": []})
        entry["count"] += 1
        entry["active_params"] += row["active_params"]
        entry["dense_params"] += row["dense_params"]
        entry["active_params_each"].append(row["active_params"])
    encoder = sum(v["active_params"] for k, v in by_kind.items() if k in ENCODER_KINDS)
    encoder_dense = sum(v["dense_params"] for k, v in by_kind.items() if k in ENCODER_KINDS)

    # FLOPs per token of the forward pass: TT layers at their active ranks, dense linears, and the
    # attention score/value products (2 x seq_len x hidden each per layer).
    attn = 4 * cfg.data.seq_len * cfg.model.hidden_size * cfg.model.num_layers
    tt_flops = sum(r["flops_per_token"] for r in report["layers"].values())
    dense_tt_flops = sum(2 * r["dense_params"] for r in report["layers"].values()
                         if r["kind"] != "TTEmbedding")  # a dense table lookup costs no FLOPs
    # A head tied to a TTM table (TiedTTHead, not an nn.Linear): its cost-model order vs a dense V x C GEMM.
    heads = [m for m in model.modules() if isinstance(m, TiedTTHead)]
    forward = tt_flops + _linear_flops(model) + attn + sum(h.flops_per_token() for h in heads)
    forward_dense = dense_tt_flops + _linear_flops(model) + attn + sum(2 * h.in_features * h.out_features
                                                                        for h in heads)

    # model.activation_checkpointing runs every block's forward once more, in backward
    recomputed = recomputed_dense = 0
    if cfg.model.activation_checkpointing:
        blocks = model.get_submodule("blocks")
        in_blocks = [r for r in report["layers"].values() if r["layer_kind"] in ENCODER_KINDS]
        recomputed = sum(r["flops_per_token"] for r in in_blocks) + _linear_flops(blocks) + attn
        recomputed_dense = sum(2 * r["dense_params"] for r in in_blocks) + _linear_flops(blocks) + attn

    sizes = solve_batch_sizes(cfg.deepspeed, world_size)
    lrs = [g["lr"] for g in param_groups(model, cfg.comera.lr)]
    ds = to_deepspeed_dict(cfg.deepspeed, world_size, total_steps=cfg.train.steps, group_lrs=lrs,
                           weight_decay=cfg.comera.lr.weight_decay)
    total = report["leftover_params"] + report["size"]
    return {
        "arch": cfg.model.arch,
        "world_size": world_size,
        "prunes": len(plans),
        "batch": {"global": sizes.global_batch, "micro": sizes.micro_batch,
                  "accumulation": sizes.accumulation, "tokens_per_step": sizes.global_batch * cfg.data.seq_len},
        "params": {"total": total, "dense_equivalent": report["leftover_params"] + report["dense_params_tensorized"],
                   "tensorized_active": report["size"], "tensorized_dense": report["dense_params_tensorized"],
                   "leftover": report["leftover_params"], "gates": report["gate_params"],
                   "allocated": sum(p.numel() for p in model.parameters())},
        "tt_params_by_kind": by_kind,
        "encoder_tt_params": encoder,
        "encoder_dense_params": encoder_dense,
        "compression": {"ratio_model": report["compression_ratio_model"],
                        "ratio_tensorized": report["compression_ratio_tensorized"]},
        "flops_per_token": {"forward": forward, "forward_dense": forward_dense,
                            "train": 3 * forward + recomputed, "train_dense": 3 * forward_dense + recomputed_dense,
                            "recomputed": recomputed},
        "layers": report["layers"],
        "deepspeed": ds,
        "config": resolved_dict(cfg),
    }


def format_summary(s: dict[str, Any]) -> str:
    """Human-readable form of ``run_summary``."""
    p, c, f, b = s["params"], s["compression"], s["flops_per_token"], s["batch"]
    lines = [
        (f"model {s['arch']} on {s['world_size']} rank(s): batch {b['global']} = {b['micro']} micro x "
         f"{b['accumulation']} accumulation x {s['world_size']} ranks ({b['tokens_per_step']:,} tokens/step)"),
        (f"parameters: {p['total']:,} trained vs {p['dense_equivalent']:,} dense "
         f"(TT cores {p['tensorized_active']:,} replace {p['tensorized_dense']:,}; dense leftovers "
         f"{p['leftover']:,}; gates {p['gates']:,})"),
        f"compression: {c['ratio_model']:.2f}x whole model, {c['ratio_tensorized']:.2f}x tensorized layers",
        (f"FLOPs/token: forward {f['forward']:,} (dense {f['forward_dense']:,}), "
         f"train ~{f['train']:,} (dense ~{f['train_dense']:,})"
         + (f", with the blocks' forward recomputed (+{f['recomputed']:,})" if f["recomputed"] else "")
         + (" and their TT factors remade in it" if f["recomputed"] and s["config"]["model"].get("recompute_factors")
            else "")),
    ]
    for kind in KINDS:
        if kind in s["tt_params_by_kind"]:
            e = s["tt_params_by_kind"][kind]
            each = sorted(set(e["active_params_each"]))
            lines.append(f"  {kind:<9} x{e['count']:<3} TT params {e['active_params']:>12,} "
                         f"(each {', '.join(f'{v:,}' for v in each)}) vs dense {e['dense_params']:,}")
    lines.append(f"  encoder TT params {s['encoder_tt_params']:,} vs dense {s['encoder_dense_params']:,}")
    if "resume" in s:  # the dry run's
        shapes = f"after its {s['prunes']} prune(s)" if s["prunes"] else "not pruned"
        lines.append(f"resumes {s['resume']} if it verifies (the sizes above are its shapes, {shapes}; its gates "
                     "may hold fewer ranks alive)" if s["resume"] else "starts fresh (no checkpoint to resume)")
    lines.append("DeepSpeed config:")
    lines.append(json.dumps(s["deepspeed"], indent=2))
    return "\n".join(lines)
