"""A tiny tensorized model, deterministic synthetic batches, and the rank functions of the engine tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from comera_dist.config import RunConfig, build_run_config

VOCAB, HIDDEN, SEQ, MICRO = 64, 16, 8, 2


def tiny_config(output_dir: Path | str, *, zero_stage: int = 0, steps: int = 4, accumulation: int = 1,
                late_stage_step: int | None = None, prune_every: int = 0, gamma: float = 0.01,
                dropout: float = 0.0, arch: str = "bert_mlm", ffn: bool = True, recompute: bool | str = False,
                layers: int = 1, **deepspeed: Any) -> RunConfig:
    """A 1-block BERT-like MLM (or ``arch="gpt"``: the causal model) with TT attention/FFN (4 cores) and
    a TTM embedding; dropout off unless asked for (a resume test needs it on: only then does the
    restored RNG stream matter); ``ffn=False`` keeps the FFN dense (``layers.dense.Linear``); ``recompute``:
    ``model.activation_checkpointing`` (``"factors"``: and ``model.recompute_factors``); ``layers`` blocks."""
    data = {
        "model": {"arch": arch, "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_layers": layers,
                  "num_heads": 2, "intermediate_size": 32, "max_positions": 16, "dropout": dropout,
                  "activation_checkpointing": bool(recompute), "recompute_factors": recompute == "factors"},
        "comera": {"tensorize": {"num_cores": 4, "embedding_num_cores": 2, "max_rank": 4,
                                 "embedding_max_rank": 4, "ffn": ffn},
                   "controller": {"gamma": gamma, "late_stage_step": late_stage_step, "target_ratio": 0.5,
                                  "target_loss": 3.0},
                   "pruning": {"every": prune_every, "start_step": 0, "min_rank": 1},
                   "lr": {"cores": 1e-2, "gates": 5e-2, "dense": 1e-2}},
        "data": {"seq_len": SEQ},
        "train": {"steps": steps, "output_dir": str(output_dir), "seed": 0, "keep_checkpoints": 3},
        "deepspeed": {"zero_stage": zero_stage, "micro_batch_size_per_gpu": MICRO,
                      "gradient_accumulation_steps": accumulation, "gradient_clipping": 1.0,
                      "stage3_param_persistence_threshold": 0, "scheduler": {"kind": "constant"},
                      **deepspeed},
        "metrics": {"prometheus": False, "progress": False},
    }
    return build_run_config(data)



def with_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """``cfg`` with ``--set``-style ``overrides`` applied, validated as a run's config is."""
    from comera_dist.config import apply_overrides, resolved_dict

    return build_run_config(apply_overrides(resolved_dict(cfg), overrides))

def factory(cfg: RunConfig):
    from comera_dist.models import build_model

    return lambda: build_model(cfg.model, cfg.comera.tensorize)


def batch(step: int, rank: int, micro: int = 0) -> dict[str, torch.Tensor]:
    """Micro-batch ``micro`` of ``rank`` at ``step``: (MICRO, SEQ) ids, MLM labels on ~40% of positions."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    ids = torch.randint(5, VOCAB, (MICRO, SEQ), generator=g)  # (B, T)
    pick = torch.rand(MICRO, SEQ, generator=g) < 0.4  # (B, T)
    pick[:, 0] = True  # at least one label per row
    labels = torch.where(pick, ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "labels": labels}


def micro_batches(step: int, rank: int, accumulation: int) -> list[dict[str, torch.Tensor]]:
    return [batch(step, rank, m) for m in range(accumulation)]


def full_params(session) -> dict[str, torch.Tensor]:
    """Every parameter of the session's model as full fp32 (collective under ZeRO), by its per-module
    name (``engine.packing``: a packed engine's flat parameters are split back into their pieces)."""
    from comera_dist.engine.hooks import full_fp32
    from comera_dist.engine.packing import unpack_state

    params = {n: full_fp32(p).clone() for n, p in session.module.named_parameters()}
    unpack_state(session.module, params, {})
    return params


def model_with(cfg: RunConfig, params: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A plain (not DeepSpeed) model of ``cfg`` holding ``params`` (``full_params``' output): a reference's."""
    model = factory(cfg)()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(params[name])
    return model


def master(session, layer: torch.nn.Module, attr: str = "gate") -> torch.Tensor:
    """The fp32 master of ``layer.<attr>`` (collective under ZeRO), flat, packed or not (``packing.holder``)."""
    from comera_dist.engine.hooks import full_fp32
    from comera_dist.engine.packing import holder

    param, where = holder(session.module, layer, attr)
    return full_fp32(param).reshape(-1)[where]


def kill_two_ranks(session, layer_name: str, bond: int) -> None:
    """Two gate entries of ``bond`` in the fp32 master far below tau (collective): the next prune
    slices them out. The module's working gate only follows the master at the next optimizer step,
    whose (still unmasked) gradient moves these entries by at most ~lr; later steps give them none."""
    from deepspeed.utils import safe_set_full_fp32_param

    from comera_dist.engine.hooks import full_fp32, full_shape
    from comera_dist.engine.packing import holder

    layer = dict(session.module.named_modules())[layer_name]
    param, where = holder(session.module, layer, "gate")
    value = full_fp32(param).reshape(-1)
    at = where.start + layer.bond_offsets()[bond]  # bond's part of the layer's gate vector
    value[at:at + 2] = -1.0
    safe_set_full_fp32_param(param, value.reshape(full_shape(param)))


KNOB_CASES = ((1, "bf16", 1), (2, "fp32", 2))
"""(ZeRO stage, precision, micro-batches per step) at which a ``deepspeed`` knob is run both ways."""


def knob_runs(outdir: str, rank: int, world_size: int, knob: str, extra: Callable[[Any], dict]) -> dict:
    """Three steps with ``deepspeed.<knob>`` true and false at each of ``KNOB_CASES``:
    ``{(stage, value): {"losses", "params", **extra(session)}}`` (collective)."""
    from comera_dist.engine.session import TrainSession

    out: dict = {}
    for stage, precision, accum in KNOB_CASES:
        for value in (True, False):
            cfg = tiny_config(f"{outdir}/{knob}{stage}{value}", zero_stage=stage, precision=precision,
                              accumulation=accum, **{knob: value})
            s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
            losses = [s.train_step([batch(step, rank, m) for m in range(accum)]).task_loss for step in (1, 2, 3)]
            out[(stage, value)] = {"losses": losses, "params": full_params(s), **extra(s)}
            s.close()
    return out


ZERO_GRADIENT = ("attn.key.bias",)
"""Parameters whose exact gradient is 0 (a key bias shifts every score of a query alike, which softmax ignores):
what they receive is rounding, which AdamW scales up to learning-rate-sized steps, so two runs that round
differently move them apart. ``assert_same_training(noise=ZERO_GRADIENT)`` only checks they stay that small."""


def assert_same_training(got: dict, want: dict, stage: int, noise: tuple[str, ...] = ()) -> None:
    """Two ``knob_runs`` entries trained the same: losses and every weight, and the losses moved. Parameters
    whose names end in ``noise`` (``ZERO_GRADIENT``) are only checked to stay below 1e-3 in both."""
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), rtol=1e-5, atol=1e-6)
    assert want["losses"][2] != want["losses"][0]  # it trained
    assert got["params"].keys() == want["params"].keys()
    for name, value in want["params"].items():
        if name.endswith(noise) and noise:
            assert max(float(got["params"][name].abs().max()), float(value.abs().max())) < 1e-3, name
            continue
        torch.testing.assert_close(got["params"][name], value, rtol=1e-5, atol=1e-6, msg=f"z{stage} {name}")
