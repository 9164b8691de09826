"""``python -m comera_dist.bench trainer-rate``: the real trainer's step rate vs the bare CoMERA step.

One run, one device (``--device``; default cuda when a GPU is visible, else the CPU), one config
(``--config``, default ``configs/six-encoder-mlm.yaml``, with ``--set key=value`` overrides applied
by ``config.load_run_config`` exactly as ``comera pretrain --set`` applies them):

1. **bench**: the trainer's model (``engine.model_factory.build_run_model(cfg)``) on the device, and
   the bare CoMERA step of ``bench six-encoder``: forward + backward + fused ``torch.optim.AdamW`` over
   ``compression.groups.param_groups(model, cfg.comera.lr)``, the objective through
   ``RankController.objective`` (early stage: task loss + gamma * R). Eager, under ``torch.autocast``
   in bf16 over fp32 weights when ``deepspeed.precision`` is bf16. The batch is a
   random MLM batch of the trainer's micro-batch shape: ``input_ids`` (B, T) uniform over the
   vocabulary, ``labels`` the ids at 15% of the positions and -100 elsewhere, with the collator's
   ``mlm_positions`` (the head runs at those rows, as in the trainer), B =
   ``deepspeed.micro_batch_size_per_gpu``, T = ``data.seq_len``. ``--warmup`` untimed steps, then
   ``--steps`` timed ones with a device synchronize before and after each (as ``six-encoder`` times);
   ``bench_tokens_per_s`` = B * T / median step time.
2. **trainer**: the same config trained by ``engine.trainer.train`` in this process as a 1-rank job,
   the way ``bench soak`` runs it: the same ``load_run_config`` + ``train()`` that the recorded
   ``command`` (``comera pretrain --config ... --set ... --resume none``) runs, DeepSpeed (ZeRO stage,
   precision, its AdamW) from the config, the real data pipeline (the corpus and tokenizer are
   prepared first, or read from ``$COMERA_CACHE``). ``train.steps`` = ``--skip`` + ``--steps`` + 4 (below); no
   evaluation or checkpoint inside the timed steps (the trainer always evaluates at step 0 and
   evaluates and checkpoints after the last step, outside every step's timing); no Prometheus,
   progress bar or report; the periodic compression report only after the last step.
   ``trainer_tokens_per_s`` is the median, over the steps after the first ``--skip`` (allocations,
   cuBLAS/cuDNN start-up), of the trainer's own ``tokens_per_second``: the values it logged through
   ``Metrics.log``, read from the run's ``metrics.history`` when it closes (the same numbers its
   ``step N/M ... tokens_per_second X`` log lines print). The trainer times ``perf_counter`` around
   fetching the batch and ``session.train_step`` and synchronizes the accelerator before reading the
   clock, so a step time covers the step's device work, like the bench's.
   ``trainer_loop_tokens_per_s`` (reported, not the target) is the loop's wall rate: the tokens of one
   trainer step (B * ``deepspeed.gradient_accumulation_steps`` * T, as the trainer counts them,
   ``trainer_tokens_per_step``) over the median interval between the starts of consecutive timed
   ``session.train_step`` calls, which also covers the metrics call and the host work between steps.
   ``trainer_step_s`` and ``trainer_data_wait_s``: the medians of the trainer's ``step_time_seconds`` and of the part of it
   spent waiting for the batch (``data_wait_seconds``: the loader's prefetch falling behind).

So the ratio compares one optimizer step of the same model on the same device at the same batch:
the trainer's (DeepSpeed engine, bf16 weights in DeepSpeed's bf16 mode, ZeRO's optimizer, the
session's host reads of the global loss and objective, the data loader) against the bare
eager step (autocast over fp32 weights, no DeepSpeed, a fixed batch already on the device).
Metrics: ``bench_tokens_per_s``, ``trainer_tokens_per_s``, ``trainer_rate_over_bench`` (target 0.8)
and ``trainer_loop_tokens_per_s``; on a GPU also ``trainer_rate_over_bench_graph`` (target 0.8 as well:
the bare step captured in one CUDA graph, ``targets``).

3. **session** (after the trainer, in its process group): the trainer's ``TrainSession.train_step``
   alone, on one fixed batch already on the device (``session_tokens_per_s``,
   ``session_rate_over_bench``). It splits the gap: bench -> session is DeepSpeed and the session's
   objective, all-reduces and host reads; session -> trainer is the data loader, metrics and logging.
   ``config["profile"]`` holds the top ops (self CPU time) of one bare step and one session step, and
   ``config["host_profile"]`` their top Python functions by own and by cumulative time, per step over 5
   profiled steps (``bench.host_profile``, cProfile): the host work between the ops (DeepSpeed's
   bookkeeping, hooks, the session's objective), and which phase holds it. ``config["host_profile"]["trainer
   loop"]`` is the same view of 3 whole iterations of the trainer's loop, run after its timed steps and left
   out of every rate (one more step ends the profile): what the trainer adds around the session step (the
   batch fetch, the device synchronize that ends each step's timing, the step's metrics and logging).
   ``host_ops_per_step_session``: the session step's top-level aten ops outside compiled graphs
   (``compile_stats.host_ops``, by the profiler), comparable between eager and ``train.compile`` runs.
   ``config["compile_counters"]`` (compiled runs) and ``config["cudagraph_trees"]`` (CUDA): what Dynamo
   and inductor counted, and the CUDA-graph tree's recordings, re-recordings and eager warm-ups, for the
   trainer (read when it ends) and the session step (``bench.compile_stats``).

``--smoke``: ``configs/codebert-tiny-cpu.yaml`` shrunk like
``launch/gpu_check.sh --cpu-smoke`` (CI, under a minute on a CPU).
"""

from __future__ import annotations

import cProfile
import itertools
import os
import shlex
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from comera_dist.bench.common import base_parser, device_option, require_device, single_rank_env, write_result
from comera_dist.bench.compile_stats import compile_counters, cudagraph_trees, host_ops
from comera_dist.bench.host_profile import host_profile, profile_rows
from comera_dist.bench.six_encoder import time_steps, top_ops
from comera_dist.bench.summary import TARGETS

CONFIG = "configs/six-encoder-mlm.yaml"
SMOKE_CONFIG = "configs/codebert-tiny-cpu.yaml"
SMOKE_SETS = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1", "model.num_heads=2",
              "model.vocab_size=512", "data.tokenizer.vocab_size=512", "data.max_files=30", "data.seq_len=32",
              "deepspeed.micro_batch_size_per_gpu=4", "comera.tensorize.max_rank=4",
              "comera.tensorize.embedding_max_rank=4"]
"""``--smoke``: the tiny CodeBERT shrunk as ``launch/gpu_check.sh --cpu-smoke`` shrinks it."""
TARGET = next(t for m, _, t, _ in TARGETS["trainer-rate"] if m == "trainer_rate_over_bench")
"""The trainer's rate over the bare step's it must reach (``bench.summary.TARGETS``, which judges the JSONs)."""
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16}
PROFILED_LOOP_STEPS = 3
"""Trainer loop iterations profiled (cProfile) after the timed ones, and left out of every rate."""
MLM_PROBABILITY = 0.15


def targets(metrics: dict[str, float]) -> dict[str, float]:
    """The run's targets (``bench.summary.TARGETS``): the trainer at ``TARGET`` of the bare eager step, and,
    where the bare step was also captured in one CUDA graph (on a GPU), of that step too: the benchmark's
    CoMERA step rate is its best mode's, and a trainer compiled with CUDA graphs
    (``train.compile_mode=reduce-overhead``) beats the eager step long before it keeps up with the captured one."""
    return {m: t for m, _, t, _ in TARGETS["trainer-rate"] if m == "trainer_rate_over_bench" or m in metrics}


def trainer_tokens_per_step(cfg, world_size: int = 1) -> int:
    """Tokens of one optimizer step of the trainer over ``world_size`` ranks, as it counts them
    (``RunData.tokens_per_step``): micro-batch x gradient accumulation x world size x ``data.seq_len``."""
    from comera_dist.engine.config import solve_batch_sizes

    return solve_batch_sizes(cfg.deepspeed, world_size).global_batch * cfg.data.seq_len


def loop_tokens_per_s(tokens_per_step: int, starts: list[float]) -> float:
    """The loop's wall rate: ``tokens_per_step`` over the median interval between consecutive step ``starts``
    (seconds); NaN with fewer than two."""
    intervals = [b - a for a, b in itertools.pairwise(starts)]
    return tokens_per_step / statistics.median(intervals) if intervals else float("nan")


def rate_rows(bench: dict[str, Any], session: dict[str, Any], trainer: dict[str, Any],
              graph_tps: float | None) -> list[dict[str, Any]]:
    """The table: tokens/s and seconds per step of each contender, each step its own tokens (the bare step
    and the session's micro-batches ``bench["tokens_per_step"]`` each, the trainer's ``trainer["tokens_per_step"]``)."""
    session_tokens = bench["tokens_per_step"] * session["micro_batches"]
    return [{"contender": "bench (bare CoMERA step)", "tokens_per_s": bench["tokens_per_step"] / bench["step_s"],
             "step_s": bench["step_s"]},
            *([{"contender": "bench, one CUDA graph", "tokens_per_s": graph_tps,
                "step_s": bench["tokens_per_step"] / graph_tps}] if graph_tps else []),
            {"contender": "session step (DeepSpeed, fixed batch)", "tokens_per_s": session_tokens / session["step_s"],
             "step_s": session["step_s"]},
            {"contender": "trainer (its tokens_per_second)", "tokens_per_s": trainer["tokens_per_s"],
             "step_s": trainer["tokens_per_step"] / trainer["tokens_per_s"]},
            {"contender": "trainer loop (wall)", "tokens_per_s": trainer["loop_tokens_per_s"],
             "step_s": trainer["tokens_per_step"] / trainer["loop_tokens_per_s"]}]


def trainer_steps(skip: int, steps: int) -> int:
    """The trainer run's ``train.steps``: the skipped and timed steps, the profiled loop iterations and the
    step whose start ends their profile."""
    return skip + steps + PROFILED_LOOP_STEPS + 1


def trainer_sets(steps: int, out_dir: Path) -> list[str]:
    """Overrides of the timed trainer run (the caller's ``--set`` values come after and win)."""
    return [f"train.steps={steps}", f"train.output_dir={out_dir}", "train.resume=none",
            "train.eval_every=0", "train.checkpoint_every=0",  # 0: only after the last step
            "train.eval_batches=1", f"train.log_every={steps}", "metrics.prometheus=false",
            "metrics.progress=false", "metrics.report=false"]


def random_mlm_batch(vocab_size: int, batch: int, seq_len: int, device: torch.device,
                     seed: int = 0) -> dict[str, Tensor]:
    """input_ids (B, T) uniform over the vocabulary; as the MLM collator gives them, ``mlm_positions``
    (B, P): a random P = round(15% of T) positions per row, and labels (B, T): the ids there, -100 elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=gen)  # (B, T)
    count = max(1, round(MLM_PROBABILITY * seq_len))
    positions = torch.rand(batch, seq_len, generator=gen).argsort(dim=1)[:, :count].sort(dim=1).values  # (B, P)
    labels = torch.full_like(ids, -100).scatter(1, positions, ids.gather(1, positions))  # (B, T)
    return {"input_ids": ids.to(device), "labels": labels.to(device), "mlm_positions": positions.to(device)}


def cuda_syncs(step: Callable[[], Any]) -> int | None:
    """Synchronizing CUDA calls (``.item()``, device-to-host copies, data-dependent shapes ...) made by one
    ``step``, as CUDA's sync debug mode reports them; None off CUDA."""
    if not torch.cuda.is_available():
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def aten_ops(step: Callable[[], Any]) -> int:
    """aten ops dispatched by one ``step`` (``bench.ops.count_step``: views included), on any device."""
    from comera_dist.bench.ops import count_step

    return sum(count_step(step, warmup=0).ops.values())


def bare_contender(cfg, device: torch.device, *, capturable: bool = False):
    """The bare CoMERA step of ``cfg``'s model (see the module docstring) as a ``six_encoder.Contender``;
    ``capturable``: the AdamW keeps its step counts on the device (``bench.graphed``)."""
    from comera_dist.bench.six_encoder import ADAMW, Contender
    from comera_dist.compression.accounting import model_size
    from comera_dist.compression.controller import RankController
    from comera_dist.compression.groups import param_groups
    from comera_dist.compression.penalty import rank_penalty
    from comera_dist.engine.model_factory import build_run_model

    torch.manual_seed(cfg.train.seed)
    model = build_run_model(cfg).to(device)
    lr = cfg.comera.lr
    opt = torch.optim.AdamW(param_groups(model, lr), weight_decay=lr.weight_decay, capturable=capturable, **ADAMW)
    controller = RankController(cfg.comera.controller)
    size = model_size(model)  # host inputs of the late stage; the benchmark stays in the early stage

    def loss(batch: dict[str, Tensor]) -> Tensor:
        out = model(**batch)
        penalty = out.get("rank_penalty")  # six_encoder_cls gives R from its masks; bert_mlm does not
        return controller.objective(out["loss"], rank_penalty(model) if penalty is None else penalty,
                                    global_loss=1.0, global_size=size)

    return Contender(name="comera", model=model, optimizer=opt, loss=loss, autocast=AUTOCAST[cfg.deepspeed.precision])


def bench_rate(cfg, device: torch.device, steps: int, warmup: int) -> dict[str, Any]:
    """The bare CoMERA step of ``cfg``'s model at the trainer's micro-batch (see the module docstring)."""
    c = bare_contender(cfg, device)
    b, t = cfg.deepspeed.micro_batch_size_per_gpu, cfg.data.seq_len
    batch = random_mlm_batch(cfg.model.vocab_size, b, t, device)
    for _ in range(warmup):
        c.step(batch)
    timed = time_steps(c.train_step, batch, steps)  # a device synchronize around each step
    return {"step_s": timed["median_s"], "step_min_s": timed["min_s"], "tokens_per_step": b * t,
            "params": sum(p.numel() for p in c.model.parameters()), "profile": top_ops(lambda: c.step(batch), 16),
            "host_profile": host_profile(lambda: c.step(batch)),
            "syncs": cuda_syncs(lambda: c.step(batch)), "ops": aten_ops(lambda: c.step(batch))}


def graph_rate(cfg, device: torch.device, steps: int) -> dict[str, Any]:
    """The same bare step captured whole in one CUDA graph (``bench.graphed.GraphedStep``, as ``bench
    six-encoder``'s graph mode), on a fresh model with a capturable AdamW. A capture that fails (a host
    sync in the step) is reported with its error instead of ending the run."""
    from comera_dist.bench.graphed import GraphedStep

    c = bare_contender(cfg, device, capturable=True)
    batch = random_mlm_batch(cfg.model.vocab_size, cfg.deepspeed.micro_batch_size_per_gpu, cfg.data.seq_len, device)
    try:
        graphed = GraphedStep(c.loss, c.optimizer, batch, autocast=c.autocast)  # warm-up steps + capture
    except Exception as e:  # noqa: BLE001 - the benchmark records why the step cannot be captured
        return {"step_s": None, "error": f"{type(e).__name__}: {e}"[:500]}
    timed = time_steps(graphed.step, batch, steps)
    return {"step_s": timed["median_s"], "step_min_s": timed["min_s"], "error": None}


def session_rate(cfg, device: torch.device, steps: int, warmup: int) -> dict[str, Any]:
    """The trainer's own ``TrainSession.train_step`` (DeepSpeed engine and optimizer, the session's
    objective, all-reduces and host reads) on one fixed batch already on the device: the trainer's
    step without its data loader, metrics and logging. Needs the process group the trainer made."""
    from comera_dist.engine.model_factory import build_run_model
    from comera_dist.engine.session import TrainSession
    from comera_dist.engine.trainer import maybe_compile

    session = TrainSession.create(cfg, lambda: build_run_model(cfg), world_size=1)
    maybe_compile(cfg, session)  # train.compile / train.compile_mode, as the trainer applies them
    batch = random_mlm_batch(cfg.model.vocab_size, cfg.deepspeed.micro_batch_size_per_gpu, cfg.data.seq_len, device)
    micro = [batch] * session.accumulation
    for _ in range(warmup):
        session.train_step(micro)
    timed = time_steps(lambda _: session.train_step(micro), batch, steps)
    return {"step_s": timed["median_s"], "micro_batches": session.accumulation,
            "profile": top_ops(lambda: session.train_step(micro), 16),
            "host_profile": host_profile(lambda: session.train_step(micro)),
            "syncs": cuda_syncs(lambda: session.train_step(micro)),
            "host_ops": host_ops(lambda: session.train_step(micro)),
            "cudagraph_trees": cudagraph_trees(device),
            # a dispatch mode around a compiled step would count the fallback, not the graph
            "ops": None if cfg.train.compile else aten_ops(lambda: session.train_step(micro))}


def _single_rank_env(device: torch.device) -> None:
    """``common.single_rank_env``, and DeepSpeed's accelerator = the device."""
    single_rank_env()
    accelerator = "cuda" if device.type == "cuda" else "cpu"
    if os.environ.setdefault("DS_ACCELERATOR", accelerator) != accelerator:
        raise SystemExit(f"trainer-rate: DS_ACCELERATOR={os.environ['DS_ACCELERATOR']} but --device {device}")


def _observe(session_cls, metrics_cls, starts: list[float], histories: list[Any],
             profile_loop: tuple[cProfile.Profile, int, int] | None = None) -> Callable[[], None]:
    """Wrap ``train_step`` (start time of every step) and ``Metrics.close`` (keep the run's history);
    returns the function that puts the real methods back. ``profile_loop`` ``(profiler, first, count)``: the
    profiler runs from the start of the ``first``-th ``train_step`` (1-based) to the start of the
    ``first + count``-th, so it records ``count`` whole iterations of the trainer's loop."""
    step, close = session_cls.train_step, metrics_cls.close

    def train_step(self, *args, **kwargs):
        starts.append(time.perf_counter())
        if profile_loop is not None:
            profiler, first, count = profile_loop
            if len(starts) == first:
                profiler.enable()
            elif len(starts) == first + count:
                profiler.disable()
        return step(self, *args, **kwargs)

    def observed_close(self, *args, **kwargs):  # close(failed=...) as the trainer calls it
        histories.append(self.history)
        return close(self, *args, **kwargs)

    session_cls.train_step, metrics_cls.close = train_step, observed_close

    def restore() -> None:
        session_cls.train_step, metrics_cls.close = step, close
        if profile_loop is not None:
            profile_loop[0].disable()  # a run that ended inside the profiled steps

    return restore


def trainer_rate(config: str, sets: list[str], skip: int, steps: int, out_dir: Path) -> dict[str, Any]:
    """Train ``config`` for ``trainer_steps(skip, steps)`` steps in this process; the trainer's own per-step
    rates over steps ``skip + 1 .. skip + steps``, then ``PROFILED_LOOP_STEPS`` whole loop iterations under
    cProfile (``loop_profile``: the data fetch, the session step, the device synchronize, the metrics) and one
    more step, whose start ends the profile."""
    from comera_dist.config import load_run_config
    from comera_dist.engine.device import accelerator_device
    from comera_dist.engine.session import TrainSession
    from comera_dist.engine.trainer import train
    from comera_dist.metrics import Metrics

    cfg = load_run_config(config, sets)
    starts: list[float] = []
    histories: list[Any] = []
    profiler = cProfile.Profile()
    restore = _observe(TrainSession, Metrics, starts, histories, (profiler, skip + steps + 1, PROFILED_LOOP_STEPS))
    t0 = time.perf_counter()
    try:
        status = train(cfg, resume=cfg.train.resume)
    finally:
        restore()
    wall = time.perf_counter() - t0
    trees = cudagraph_trees(accelerator_device())  # before the session's compile resets them
    if status != 0 or not histories:
        raise SystemExit(f"trainer-rate: the trainer exited with status {status}")
    history = histories[-1]
    per_step = dict(history.scalars["tokens_per_second"])  # {step: tokens/s}, the trainer's own values
    stages = dict(history.scalars["stage"])
    timed = [s for s in sorted(per_step) if skip < s <= skip + steps]
    if len(timed) != steps or len(starts) != trainer_steps(skip, steps):
        raise SystemExit(f"trainer-rate: expected {trainer_steps(skip, steps)} logged steps, got {sorted(per_step)}")
    tokens = trainer_tokens_per_step(cfg)
    waits = dict(history.scalars["data_wait_seconds"])
    step_times = dict(history.scalars["step_time_seconds"])
    return {"tokens_per_s": statistics.median(per_step[s] for s in timed),
            "data_wait_s": statistics.median(waits[s] for s in timed),
            "step_s": statistics.median(step_times[s] for s in timed),
            "tokens_per_step": tokens, "loop_tokens_per_s": loop_tokens_per_s(tokens, starts[skip:skip + steps + 1]),
            "loop_profile": profile_rows(profiler, PROFILED_LOOP_STEPS, roots=True),
            "per_step": {s: v for s, v in per_step.items() if s <= skip + steps},  # the profiled ones are in no rate
            "late_stage_steps": [s for s in timed if stages.get(s, 0.0) >= 1],
            "wall_seconds": wall, "cudagraph_trees": trees}


def main(argv: list[str]) -> int:
    p = base_parser("trainer-rate", __doc__.splitlines()[0])
    p.add_argument("--config", default=None, help=f"run config (default {CONFIG}; with --smoke {SMOKE_CONFIG})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, as `comera pretrain --set` (repeatable; applied to both halves)")
    p.add_argument("--smoke", action="store_true", help="tiny CPU-sized model and data (CI): " + " ".join(SMOKE_SETS))
    p.add_argument("--device", type=device_option, default=None, help="cuda or cpu (default: cuda when a GPU is visible)")
    p.add_argument("--warmup", type=int, default=3, help="untimed bench steps before the timed ones")
    p.add_argument("--skip", type=int, default=5, help="first trainer steps left out of its median")
    p.add_argument("--out", type=Path, default=None, help="trainer run directory (default: a temporary one)")
    args = p.parse_args(argv)
    steps = (5 if args.smoke else 30) if args.steps is None else args.steps
    if args.batch_size is not None:
        p.error("--batch-size: the batch is the config's; use --set deepspeed.micro_batch_size_per_gpu=B")
    if steps < 2 or args.skip < 1 or args.warmup < 0:
        p.error(f"need --steps >= 2, --skip >= 1, --warmup >= 0; got {steps}, {args.skip}, {args.warmup}")
    device = require_device(p, args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    config = args.config or (SMOKE_CONFIG if args.smoke else CONFIG)
    user_sets = (SMOKE_SETS if args.smoke else []) + args.set
    _single_rank_env(device)

    from comera_dist.config import load_run_config

    cfg = load_run_config(config, user_sets)
    bench = bench_rate(cfg, device, steps, args.warmup)
    graph = graph_rate(cfg, device, steps) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the bench's model and optimizer are gone: the trainer's engine gets the memory
    with tempfile.TemporaryDirectory(prefix="comera-trainer-rate-") as tmp:
        out_dir = args.out or Path(tmp) / "run"
        sets = trainer_sets(trainer_steps(args.skip, steps), out_dir) + user_sets
        command = shlex.join(["comera", "pretrain", "--config", config,
                              *(a for s in sets for a in ("--set", s)), "--resume", "none"])
        trainer = trainer_rate(config, sets, args.skip, steps, out_dir)
    session = session_rate(cfg, device, steps, args.warmup)
    bench_tps = bench["tokens_per_step"] / bench["step_s"]
    session_tps = bench["tokens_per_step"] * session["micro_batches"] / session["step_s"]
    metrics = {"bench_tokens_per_s": bench_tps, "trainer_tokens_per_s": trainer["tokens_per_s"],
               "trainer_rate_over_bench": trainer["tokens_per_s"] / bench_tps,
               "trainer_loop_tokens_per_s": trainer["loop_tokens_per_s"],
               "trainer_step_s": trainer["step_s"], "trainer_data_wait_s": trainer["data_wait_s"],
               "session_tokens_per_s": session_tps, "session_rate_over_bench": session_tps / bench_tps,
               "host_ops_per_step_session": session["host_ops"]}
    if session["ops"] is not None:
        metrics |= {"ops_per_step_bench": bench["ops"], "ops_per_step_session": session["ops"],
                    "ops_ratio_session_over_bench": session["ops"] / bench["ops"]}
    if graph is not None and graph["step_s"]:
        graph_tps = bench["tokens_per_step"] / graph["step_s"]
        metrics |= {"bench_graph_tokens_per_s": graph_tps,
                    "trainer_rate_over_bench_graph": trainer["tokens_per_s"] / graph_tps}
    if device.type == "cuda":
        metrics |= {"host_syncs_per_step_bench": bench["syncs"], "host_syncs_per_step_session": session["syncs"]}
    rows = rate_rows(bench, session, trainer, metrics.get("bench_graph_tokens_per_s"))
    result_config = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "config": config, "overrides": user_sets, "smoke": args.smoke, "target": targets(metrics),
        "micro_batch": cfg.deepspeed.micro_batch_size_per_gpu, "seq_len": cfg.data.seq_len,
        "precision": cfg.deepspeed.precision, "zero_stage": cfg.deepspeed.zero_stage, "world_size": 1,
        "bench_steps": steps, "bench_warmup": args.warmup, "bench_params": bench["params"],
        "trainer_steps": trainer_steps(args.skip, steps), "trainer_skipped_steps": args.skip,
        "trainer_timed_steps": steps, "trainer_profiled_steps": PROFILED_LOOP_STEPS,
        "trainer_tokens_per_step": trainer["tokens_per_step"],
        "trainer_tokens_per_second_by_step": {str(k): v for k, v in trainer["per_step"].items()},
        "trainer_late_stage_steps": trainer["late_stage_steps"], "trainer_wall_seconds": trainer["wall_seconds"],
        "profile": {"bench step": bench["profile"], "session step": session["profile"]},
        "host_profile": {"bench step": bench["host_profile"], "session step": session["host_profile"],
                         "trainer loop": trainer["loop_profile"]},
        "bench_graph_error": None if graph is None else graph["error"],
        "compile_counters": compile_counters() if cfg.train.compile else None,  # trainer and session together
        "cudagraph_trees": {"trainer": trainer["cudagraph_trees"], "session": session["cudagraph_trees"]},
        "command": command}
    write_result(args.json, "trainer-rate", metrics, rows, result_config, argv=argv)
    from comera_dist.engine.distributed import leave_distributed

    leave_distributed()  # as `comera pretrain` leaves: the process group destroyed, not left to exit
    return 0
