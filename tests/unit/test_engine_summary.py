"""``engine.summary.run_summary``, what ``comera pretrain --dry-run`` prints: its FLOPs against torch's own count
of a forward pass, its parameter counts against the model's, and its batch and optimizer arithmetic.

torch's ``FlopCounterMode`` counts every matmul of the dense model's forward, but not the CPU's fused attention
(``_scaled_dot_product_flash_attention_for_cpu``): the two products of attention, QKᵀ and AV, each
2·T·T·H per layer and sequence, are added by hand, 4·T·H·L per token."""

from __future__ import annotations

import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from comera_dist.config import load_run_config
from comera_dist.engine.model_factory import build_run_model
from comera_dist.engine.summary import format_summary, run_summary

TINY = "configs/tiny-cpu.yaml"


def _measured(cfg) -> tuple[float, float]:
    """torch's FLOPs per token of one forward of ``cfg``'s model (whole model, the blocks), attention added."""
    model = build_run_model(cfg).eval()
    seq, m = cfg.data.seq_len, cfg.model
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, m.vocab_size, (1, seq)))
    counts = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    attention = 4 * seq * m.hidden_size * m.num_layers
    blocks = sum(v for name, v in counts.items() if re.search(r"\.blocks\.\d+$", name))
    return counts["Global"] / seq + attention, blocks / seq + attention


@pytest.mark.parametrize("arch", ["bert_mlm", "gpt"])
def test_a_dense_models_flops_are_torchs_count(arch):
    cfg = load_run_config(TINY, ["comera.enabled=false", f"model.arch={arch}", "model.activation_checkpointing=true"])
    flops = run_summary(cfg, world_size=1)["flops_per_token"]
    forward, blocks = _measured(cfg)
    assert flops["forward"] == flops["forward_dense"] == forward
    assert flops["recomputed"] == blocks  # the checkpointed blocks' forward, once more in backward
    assert flops["train"] == 3 * forward + blocks


@pytest.mark.parametrize("arch", ["bert_mlm", "gpt"])
def test_a_tensorized_models_dense_equivalent_is_the_dense_model(arch):
    """What the TT model is compared with (FLOPs and parameters) is the same config's dense model: a lookup of the
    dense table costs nothing, the tied head its V x C product."""
    tt = run_summary(load_run_config(TINY, [f"model.arch={arch}"]), world_size=1)
    dense = run_summary(load_run_config(TINY, ["comera.enabled=false", f"model.arch={arch}"]), world_size=1)
    assert tt["flops_per_token"]["forward_dense"] == dense["flops_per_token"]["forward"]
    assert tt["params"]["dense_equivalent"] == dense["params"]["total"]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_parameter_counts_add_up_to_the_models(enabled):
    """Trained parameters are the TT cores at their ranks plus the dense leftovers; with the gates, every
    parameter the model allocates (a fresh model: every rank alive)."""
    cfg = load_run_config(TINY, [f"comera.enabled={str(enabled).lower()}"])
    params = run_summary(cfg, world_size=1)["params"]
    allocated = sum(p.numel() for p in build_run_model(cfg).parameters())
    assert params["total"] == params["tensorized_active"] + params["leftover"]
    assert params["total"] + params["gates"] == params["allocated"] == allocated
    assert (params["gates"] > 0) == enabled


def test_the_batch_and_the_optimizer_are_the_runs():
    """Tokens per step count every rank's micro-batches; the DeepSpeed optimizer carries the config's weight decay
    and, as its base lr, the first parameter group's (a dense run's: ``comera.lr.dense``)."""
    cfg = load_run_config(TINY, ["deepspeed.micro_batch_size_per_gpu=2", "deepspeed.gradient_accumulation_steps=3",
                                 "comera.lr.weight_decay=0.01", "comera.enabled=false", "comera.lr.dense=2e-5"])
    summary = run_summary(cfg, world_size=2)
    assert summary["batch"] == {"global": 12, "micro": 2, "accumulation": 3, "tokens_per_step": 12 * 32}
    assert summary["deepspeed"]["optimizer"]["params"]["weight_decay"] == 0.01
    assert summary["deepspeed"]["optimizer"]["params"]["lr"] == 2e-5


def test_the_text_names_each_distinct_layer_size():
    """A kind whose layers differ (one rank pruned) lists each size once."""
    from comera_dist.compression.pruning import PruningPlan, bond_dims

    cfg = load_run_config(TINY)
    dims = bond_dims(build_run_model(cfg))
    name = "blocks.0.attn.query"
    plan = PruningPlan(kept={name: {0: list(range(dims[name][0] - 1))}}, bond_dims=dims)
    summary = run_summary(cfg, world_size=1, plans=[plan.to_json()])
    sizes = sorted(set(summary["tt_params_by_kind"]["attention"]["active_params_each"]))
    assert len(sizes) == 2 and summary["layers"][name]["active_params"] == sizes[0]
    assert f"(each {sizes[0]:,}, {sizes[1]:,})" in format_summary(summary)


def test_a_head_tied_to_the_tt_table_is_counted():
    """The GPT head tied to the TTM table is no ``nn.Linear``: its contraction is in the forward. Untied, the head is
    a dense V x C product; without it, the forward would be the untied one's less that product."""
    tied = run_summary(load_run_config(TINY, ["model.arch=gpt"]), world_size=1)["flops_per_token"]
    untied = run_summary(load_run_config(TINY, ["model.arch=gpt", "model.tie_word_embeddings=false"]),
                         world_size=1)["flops_per_token"]
    headless = untied["forward"] - 2 * 512 * 32
    assert tied["forward_dense"] == untied["forward_dense"]
    assert tied["forward"] > headless
