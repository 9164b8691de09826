"""``python -m comera_dist.bench codebert``: CodeBERT-like MLM pretraining, dense vs CoMERA, equal token budget.

The model, tensorization, controller, pruning and learning rates come from a run config
(default ``configs/codebert-tiny-cpu.yaml``); the data from the project's real pipeline
(``data.prepare_data`` on the embedded stdlib corpus, ``PackedLoader``, the MLM collator,
``eval_batches`` for validation with fixed masks). Both contenders see the same batches in
the same order: the token budget ("epoch") is ``steps * batch * seq_len``.

Training uses a plain single-process loop, not the DeepSpeed engine (one process, no ZeRO:
the engine would add its launch and initialisation cost to a short CPU run and nothing to the
comparison). The loop does what the engine's step does: the CoMERA loss goes through
``RankController`` (early stage, then the late stage at ``late_stage_step``), physical pruning
follows ``pruning`` (``make_plan`` + ``apply_plan`` with the AdamW moments). The config's
step schedule (late stage, pruning) is scaled by ``--steps / train.steps``. Both contenders
use AdamW with linear warm-up (5% of steps) and cosine decay to 10%; dense uses ``lr.dense``.

``--dense-lr`` (repeatable) trains the dense contender at each given rate instead: the config's
``lr.dense`` is set for CoMERA's small dense leftovers, not for a dense encoder. The dense run with the
lowest final validation loss is the one compared; choosing on the split the ratio is measured on
favours dense, so the ratio errs against CoMERA. The other dense runs stay in the rows and the plot.

The output head follows ``model.tie_word_embeddings`` (default true) in both contenders: the dense
model ties its decoder to the dense table, the CoMERA model to the TTM table (``TiedTTHead``), so at
a large vocabulary the whole model is compressed. ``--heldout PATH`` (repeatable) also evaluates both
final models on code outside the training corpus (any local files, as ``comera evaluate`` reads
them) and reports ``heldout_loss_ratio_comera_over_dense`` beside the validation ratio.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from comera_dist.bench.common import base_parser, write_result
from comera_dist.bench.six_encoder import top_ops
from comera_dist.compression.accounting import compression_report, model_size
from comera_dist.compression.config import ComeraConfig
from comera_dist.compression.controller import RankController
from comera_dist.compression.groups import param_groups
from comera_dist.compression.penalty import rank_penalty
from comera_dist.compression.pruning import apply_plan, make_plan, prune_due
from comera_dist.config import apply_overrides
from comera_dist.configbase import from_dict, load_yaml
from comera_dist.data.config import DataConfig
from comera_dist.data.loader import PackedLoader, eval_batches
from comera_dist.data.prepare import PreparedData, evaluation_corpus, prepare_data
from comera_dist.metrics.progress import terminal_progress
from comera_dist.models import build_model
from comera_dist.models.config import ModelConfig

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "codebert-tiny-cpu.yaml"


def load_sections(path: Path, *, smoke: bool, overrides: Sequence[str] = ()
                  ) -> tuple[ModelConfig, ComeraConfig, DataConfig, dict[str, Any]]:
    """model / comera / data sections (strictly validated) and the raw train section of ``path``.

    ``overrides`` are ``section.key=value`` strings (as ``comera pretrain --set``), applied first.
    """
    raw = apply_overrides(load_yaml(path), overrides)
    for key in ("model", "comera", "data"):
        if key not in raw:
            raise ValueError(f"codebert: config {path} has no {key!r} section")
    if smoke:  # tiny sizes of the same pipeline for CI
        raw["model"].update(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_positions=32,
                            vocab_size=400)
        raw["comera"]["tensorize"].update(max_rank=4, embedding_max_rank=4)
        raw["data"].update(max_files=20, seq_len=32)
        raw["data"]["tokenizer"].update(vocab_size=400, max_train_bytes=200_000)
    model = from_dict(ModelConfig, raw["model"], "model")
    comera = from_dict(ComeraConfig, raw["comera"], "comera")
    data = from_dict(DataConfig, raw["data"], "data")
    return model, comera, data, dict(raw.get("train") or {})


def validation_loss(model: nn.Module, prepared: PreparedData, *, batch_size: int, max_batches: int,
                    dataset: Any = None) -> float:
    """Mean MLM loss over the first ``max_batches`` batches (fixed masks) of ``dataset`` (default: validation)."""
    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for batch in eval_batches(prepared.validation if dataset is None else dataset, batch_size=batch_size, rank=0,
                                  world_size=1, seed=1234, collator=prepared.collator,
                                  max_blocks=max_batches * batch_size):
            total += float(model(**batch)["loss"])
            n += 1
    model.train()
    if n == 0:
        raise ValueError("codebert: the validation split yielded no batch")
    return total / n


def train_one(name: str, model_cfg: ModelConfig, comera: ComeraConfig, prepared: PreparedData, *, steps: int,
              batch_size: int, eval_every: int, eval_batches_n: int, scale: float, seed: int,
              heldout: Any = None, heldout_batches: int = 0, dense_lr: float | None = None) -> dict[str, Any]:
    """Train ``dense`` or ``comera`` for ``steps`` steps; returns curves, timings and the final report.

    ``dense_lr``: the dense contender's learning rate (default: the config's ``lr.dense``).
    """
    torch.manual_seed(seed)
    tensorized = name == "comera"
    model = build_model(model_cfg, comera.tensorize if tensorized else None)
    lr = comera.lr
    dense_lr = lr.dense if dense_lr is None else dense_lr
    groups = param_groups(model, lr) if tensorized else [{"params": list(model.parameters()), "lr": dense_lr}]
    opt = torch.optim.AdamW(groups, weight_decay=lr.weight_decay)
    warmup = max(1, steps // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    ctl_cfg = dataclasses.replace(comera.controller, late_stage_step=None if comera.controller.late_stage_step is None
                                  else round(comera.controller.late_stage_step * scale))
    prune_cfg = dataclasses.replace(comera.pruning, every=round(comera.pruning.every * scale),
                                    start_step=round(comera.pruning.start_step * scale))
    controller = RankController(ctl_cfg)
    loader = PackedLoader(prepared.train, batch_size=batch_size, rank=0, world_size=1, seed=seed,
                          collator=prepared.collator)
    curve: list[dict[str, float]] = [{"step": 0, "val_loss": validation_loss(model, prepared, batch_size=batch_size,
                                                                           max_batches=eval_batches_n)}]
    train_s, tokens, train_losses = 0.0, 0, []
    label = name if tensorized else f"dense lr={dense_lr:g}"
    for step in terminal_progress(range(1, steps + 1), desc=f"codebert {label}", unit="step"):
        batch = next(loader)
        t0 = time.perf_counter()
        task = model(**batch)["loss"]
        loss = task
        if tensorized:
            size = model_size(model)
            controller.advance(step, float(task.detach()), size)
            loss = controller.objective(task, rank_penalty(model), global_loss=float(task.detach()), global_size=size)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if tensorized and prune_cfg.every and prune_due(prune_cfg, step):
            apply_plan(model, make_plan(model, comera.pruning.min_rank), opt)
        train_s += time.perf_counter() - t0
        tokens += batch["input_ids"].numel()
        train_losses.append(float(task.detach()))
        if step % eval_every == 0 or step == steps:
            curve.append({"step": step, "val_loss": validation_loss(model, prepared, batch_size=batch_size,
                                                                  max_batches=eval_batches_n)})
    report = compression_report(model) if tensorized else None
    heldout_loss = None if heldout is None else validation_loss(model, prepared, batch_size=batch_size,
                                                                max_batches=heldout_batches, dataset=heldout)
    profile = top_ops(lambda: model(**next(loader))["loss"].backward())  # one fwd+bwd of the final model
    opt.zero_grad(set_to_none=True)
    return {"name": name, "curve": curve, "train_s": train_s, "tokens": tokens, "final_val_loss": curve[-1]["val_loss"],
            "final_train_loss": sum(train_losses[-10:]) / len(train_losses[-10:]),
            "params": sum(p.numel() for p in model.parameters()), "report": report, "heldout_loss": heldout_loss,
            "head": type(model.head.decoder).__name__ if hasattr(model, "head") else None,
            "stage": controller.stage if tensorized else None, "profile": profile,
            "lr": None if tensorized else dense_lr}


def dense_sweep(lrs: Sequence[float], train: Callable[[float], dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Dense runs at each of ``lrs`` (``train(lr)``), keyed by contender name.

    The run with the lowest final validation loss is ``dense``; the others are ``dense lr=<lr>``.
    """
    runs = [train(lr) for lr in lrs]
    best = min(range(len(runs)), key=lambda i: runs[i]["final_val_loss"])
    return {("dense" if i == best else f"dense lr={r['lr']:g}"): r for i, r in enumerate(runs)}


def main(argv: list[str]) -> int:
    p = base_parser("codebert", "CodeBERT-like MLM on the stdlib corpus: dense vs CoMERA at an equal token budget")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="run config YAML (model/comera/data/train)")
    p.add_argument("--smoke", action="store_true", help="tiny model and corpus of the same pipeline (CI)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set model.hidden_size=384 (repeatable)")
    p.add_argument("--eval-every", type=int, default=None, help="steps between validation evaluations")
    p.add_argument("--eval-batches", type=int, default=None, help="validation batches per evaluation")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--heldout", type=Path, action="append", default=[], metavar="PATH",
                   help="files/dirs of code outside the training corpus to evaluate both final models on (repeatable)")
    p.add_argument("--heldout-batches", type=int, default=32, help="held-out batches per model")
    p.add_argument("--target-ratio", type=float, default=4.23, help="whole-model compression target (recorded)")
    p.add_argument("--dense-lr", type=float, action="append", default=[], metavar="LR",
                   help="the dense contender's learning rate (default: the config's comera.lr.dense); repeat it to "
                        "sweep: the dense run with the lowest final validation loss is the one compared")
    args = p.parse_args(argv)
    model_cfg, comera, data_cfg, train = load_sections(args.config, smoke=args.smoke, overrides=args.overrides)
    steps = int(train.get("steps", 200)) if args.steps is None else args.steps
    batch_size = 16 if args.batch_size is None else args.batch_size
    eval_every = args.eval_every or max(1, steps // 8)
    n_eval = args.eval_batches or int(train.get("eval_batches", 8))
    if min(steps, batch_size, eval_every, n_eval) < 1:
        p.error(f"--steps, --batch-size, --eval-every, --eval-batches must be >= 1, got "
                f"{steps}, {batch_size}, {eval_every}, {n_eval}")
    if any(not (math.isfinite(lr) and lr > 0) for lr in args.dense_lr) or len(set(args.dense_lr)) < len(args.dense_lr):
        p.error(f"--dense-lr must be distinct positive numbers, got {args.dense_lr}")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    prepared = prepare_data(data_cfg, show_progress=False)
    model_cfg = dataclasses.replace(model_cfg, vocab_size=max(model_cfg.vocab_size, prepared.vocab_size))
    scale = steps / int(train.get("steps", steps))
    heldout = None
    if args.heldout:
        heldout = evaluation_corpus(args.heldout, prepared.tokenizer, seq_len=data_cfg.seq_len,
                                    objective=data_cfg.objective, show_progress=False)
    def run(name: str, dense_lr: float | None = None) -> dict[str, Any]:
        return train_one(name, model_cfg, comera, prepared, steps=steps, batch_size=batch_size, eval_every=eval_every,
                         eval_batches_n=n_eval, scale=scale, seed=0, heldout=heldout,
                         heldout_batches=args.heldout_batches, dense_lr=dense_lr)

    dense_lrs = args.dense_lr or [comera.lr.dense]
    runs = dense_sweep(dense_lrs, lambda lr: run("dense", lr)) | {"comera": run("comera")}
    rows = [{"contender": n, "lr": r["lr"], "steps": steps, "tokens": r["tokens"], "train_s": r["train_s"],
             "tokens_per_s": r["tokens"] / r["train_s"], "final_val_loss": r["final_val_loss"],
             "final_train_loss": r["final_train_loss"], "heldout_loss": r["heldout_loss"], "params": r["params"],
             "head": r["head"]} for n, r in runs.items()]
    rep = runs["comera"]["report"]
    metrics = {
        "compression_ratio": rep["compression_ratio_model"],
        "compression_ratio_tensorized": rep["compression_ratio_tensorized"],
        "val_loss_ratio_comera_over_dense": runs["comera"]["final_val_loss"] / runs["dense"]["final_val_loss"],
        "epoch_speedup_vs_dense": runs["dense"]["train_s"] / runs["comera"]["train_s"],
    }
    if heldout is not None:
        metrics["heldout_loss_ratio_comera_over_dense"] = runs["comera"]["heldout_loss"] / runs["dense"]["heldout_loss"]
    config = {"config": str(args.config), "overrides": args.overrides, "vocab_size": model_cfg.vocab_size,
              "hidden_size": model_cfg.hidden_size, "tie_word_embeddings": model_cfg.tie_word_embeddings,
              "heldout": [str(h) for h in args.heldout], "heldout_blocks": None if heldout is None else len(heldout),
              "heldout_batches": args.heldout_batches, "steps": steps, "batch_size": batch_size, "seq_len": data_cfg.seq_len,
              "smoke": args.smoke, "dense_lrs": dense_lrs, "dense_lr": runs["dense"]["lr"],
              "eval_every": eval_every, "eval_batches": n_eval, "schedule_scale": scale,
              "loop": "plain single-process loop (same model, controller, pruning as the engine)",
              "final_stage": runs["comera"]["stage"], "final_ranks": {k: v["ranks"] for k, v in rep["layers"].items()},
              "curves": {n: r["curve"] for n, r in runs.items()},
              "profile": {n: r["profile"] for n, r in runs.items()}, "threads": torch.get_num_threads(),
              "target": {"compression_ratio": args.target_ratio, "val_loss_ratio_comera_over_dense": 1.03,
                         "epoch_speedup_vs_dense": 3.0},
              "load_avg_start": load_start, "load_avg_end": os.getloadavg()}
    write_result(args.json, "codebert", metrics, rows, config, argv=argv)
    return 0
