"""The training job: ``train(cfg, resume=...)`` wires data, model, DeepSpeed session and metrics.

The loop only calls components. Its contract with the outside world:

* exit 0 after ``train.steps`` steps, or after a SIGUSR1/SIGTERM (checkpoint at the next step
  boundary first, so a Slurm requeue resumes where it stopped);
* exit ``EXIT_NONFINITE`` (3) after ``train.max_nonfinite_steps`` consecutive non-finite steps,
  with a checkpoint of the last good state (skipped steps never touch the weights); also, without
  a checkpoint, when non-finite gradients were applied (``session.NonFiniteGradientsApplied``:
  bf16 with ``deepspeed.bf16_overflow_check=false``);
* exit ``EXIT_COLLAPSED`` (4), without a checkpoint, once every rank of every TT layer is dead
  (``compression.controller.RanksCollapsed``: S = 0, which no gradient can undo), or a bond of the TT
  embedding (``InputEmbeddingDead``: the model no longer sees its input), found where the ranks are read:
  at every ``train.log_every`` step, at a prune, before every checkpoint (and S = 0 at the switch to the late
  stage);
* ``resume="auto"`` continues from the latest complete checkpoint under ``train.output_dir``.
"""

from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from deepspeed.accelerator import get_accelerator

from comera_dist.compression.controller import InputEmbeddingDead, RanksCollapsed
from comera_dist.config import (
    RunConfig,
    check_pretrainable,
    check_resume_path,
    check_world_size,
    run_warnings,
    slurm_restarts,
)
from comera_dist.engine.checkpoint import CheckpointError, latest_complete, requeued_spec
from comera_dist.engine.device import accelerator_device, collective_tensor
from comera_dist.engine.distributed import DistInfo, init_distributed
from comera_dist.engine.errors import InputError
from comera_dist.engine.faults import NonFiniteInjector
from comera_dist.engine.model_factory import build_run_model
from comera_dist.engine.run_data import RunData, build_run_data, resume_tokenizer_dir
from comera_dist.engine.session import NonFiniteGradientsApplied, TrainSession
from comera_dist.engine.signals import START_SIGNALS, STOP_SIGNALS, StopRequest
from comera_dist.kernels.dispatch import check_device
from comera_dist.metrics import Metrics, build_metrics

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_NONFINITE = 3
EXIT_COLLAPSED = 4


@dataclass(slots=True)
class NonFiniteGuard:
    """Counts skipped non-finite steps; ``tripped`` after ``limit`` consecutive ones."""

    limit: int
    consecutive: int = 0
    total: int = 0

    def update(self, skipped: bool) -> None:
        self.consecutive = self.consecutive + 1 if skipped else 0
        self.total += int(skipped)

    @property
    def tripped(self) -> bool:
        return self.consecutive >= self.limit


def _model_factory(cfg: RunConfig):
    return lambda: build_run_model(cfg)


def _checkpoint(session: TrainSession, data: RunData, step: int, guard: NonFiniteGuard,
                metrics: Metrics, reason: str, *, retain: bool = True) -> Path | None:
    """Save on every rank (a collective); each rank's client state (its data position) rides along.

    None when nothing was written because the state is non-finite (the session logs which tensors).
    """
    _check_alive(session, session.compression_report())  # a dead model is not worth a checkpoint, nor a requeue
    client = {"step": step, "data_state": data.train.state_dict(), "nonfinite_steps_total": guard.total,
              "reason": reason, "tokenizer_sha256": data.tokenizer_digest}
    try:  # the history goes inside: a job resumed from this checkpoint continues the report from here
        path = session.save(step, client, retain=retain, side_files=metrics.history_files(step),
                            meta_fields={"tokenizer_sha256": data.tokenizer_digest})
    except Exception:
        metrics.checkpoint_saved(False, step)
        raise
    metrics.checkpoint_saved(path is not None, step)
    return path


def _stop_nonfinite(session: TrainSession, data: RunData, step: int, guard: NonFiniteGuard, metrics: Metrics, *,
                    rank: int) -> None:
    """The checkpoint of a run stopped by ``train.max_nonfinite_steps`` non-finite steps in a row.

    Skipped steps never touch the weights, so the state is the last good step's unless it was already
    poisoned (e.g. loaded from a corrupt file): ``session.save`` refuses non-finite tensors. No retention
    here: every older checkpoint is kept."""
    previous = latest_complete(session.checkpoint_root)
    log.error("stopping: %d consecutive non-finite steps; checkpointing the state if it is finite, "
              "keeping the previous checkpoint %s", guard.consecutive, previous)
    saved = _checkpoint(session, data, step, guard, metrics, reason="nonfinite", retain=False)
    if rank == 0:
        log.error("non-finite stop: %s; the previous checkpoint %s is kept",
                  f"wrote {saved}" if saved else "state non-finite, nothing written", previous)


def _restore(session: TrainSession, data: RunData, guard: NonFiniteGuard, spec: str) -> tuple[int, Path | None]:
    """Load ``spec`` (auto|none|path) into the session and the data loader; the step to start after and the
    checkpoint loaded (0, None: a fresh start)."""
    try:
        client = session.resume(spec)
    except CheckpointError as e:
        raise InputError(str(e).replace("\n", " ")) from e
    if client is None:
        return 0, None
    saved = client.get("tokenizer_sha256")  # absent in checkpoints from before it was recorded
    if saved is not None and saved != data.tokenizer_digest:
        raise InputError(f"resume: the checkpoint was trained with another tokenizer (sha256 {saved[:12]}) than the "
                         f"one this run prepared (sha256 {data.tokenizer_digest[:12]}), so its token ids would mean "
                         "other tokens. Put the tokenizer saved beside that checkpoint at <run>/tokenizer, or set "
                         "data.tokenizer.pretrained to it, or start over with --resume none")
    data.train.load_state_dict(client["data_state"])  # this rank's own (the session checks the world size)
    guard.total = client.get("nonfinite_steps_total", 0)
    log.info("resumed at step %d", client["step"])
    return int(client["step"]), Path(client["checkpoint_dir"])


def _requeued(cfg: RunConfig, resume: str, rank: int) -> str:
    """``resume``, or ``auto`` in a requeued Slurm job that has written a checkpoint (``checkpoint.requeued_spec``)."""
    restarts = slurm_restarts()
    spec = requeued_spec(resume, Path(cfg.train.output_dir) / "checkpoints", restarts, os.environ.get("SLURM_JOB_ID"))
    if spec != resume and rank == 0:
        log.warning("requeued job (SLURM_RESTART_COUNT=%d): resuming this job's newest checkpoint (--resume auto), "
                    "not --resume %s, which would %s at every requeue", restarts, resume,
                    "start over" if resume == "none" else "go back to that checkpoint")
    return spec


def _step_metrics(out: Any, step_time: float, data_wait: float, tokens: int,
                  guard: NonFiniteGuard) -> dict[str, float]:
    return {"train_loss": float(out.task_loss), "objective": float(out.loss), "rank_penalty": float(out.penalty),
            "lambda": float(out.lam), "stage": 0.0 if out.stage == "early" else 1.0,
            "learning_rate": float(out.lr), "grad_norm": float(out.grad_norm),
            "step_time_seconds": step_time, "data_wait_seconds": data_wait,
            "tokens_per_second": tokens / max(step_time, 1e-9),
            "nonfinite_steps_total": float(guard.total)}


def _peak_memory_bytes() -> float:
    """Peak memory of the busiest rank: the accelerator allocator's peak (DeepSpeed's accelerator, the
    device the engine runs on), or the process's max RSS when that accelerator is the CPU."""
    if accelerator_device().type != "cpu":
        value = float(get_accelerator().max_memory_allocated())
    else:
        value = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB
    if not (tdist.is_initialized() and tdist.get_world_size() > 1):
        return value
    t = collective_tensor([value])  # (1,) on the accelerator (NCCL refuses host tensors)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return float(t.item())


def _why_dead(report: dict[str, Any]) -> RanksCollapsed | None:
    """Why the model cannot train on, read off a compression report (None: it can). Not one rank of its TT layers
    alive (S = 0: ``RanksCollapsed``), or a TT embedding with a bond of no rank alive (``InputEmbeddingDead``: it
    maps every token to zero, so the model no longer sees its input). A dead projection inside a block is neither:
    the residual carries on without its sublayer, which is a compression."""
    if report["layers"] and report["size"] == 0:
        return RanksCollapsed()
    for name, row in report["layers"].items():
        if row["kind"] == "TTEmbedding" and 0 in row["ranks"]:
            return InputEmbeddingDead(name, row["ranks"])
    return None


def _check_alive(session: TrainSession, report: dict[str, Any]) -> None:
    """Raise ``_why_dead``'s reason when its gates are finite. Non-finite gates read as dead too; that state is the
    non-finite guard's to stop (exit 3, nothing saved), not a collapse, whose message points at the rank penalty's
    settings. Collective where a layer reads dead (the report is global: every rank raises at the same step)."""
    dead = _why_dead(report)
    if dead is None:
        return
    if not session.gates_finite():
        log.error("ranks read dead because rank gates are not finite (NaN/inf), not because the penalty pruned "
                  "them; the non-finite steps that follow stop the run")
        return
    raise dead


def _periodic_metrics(session: TrainSession, data: RunData) -> dict[str, float]:
    """The slower values (collective: every rank calls it at the same steps). Raises ``RanksCollapsed`` when the
    model cannot train on (``_check_alive``)."""
    report = session.compression_report()
    _check_alive(session, report)
    return {"compression_ratio": float(report["compression_ratio_model"]),
            "compression_ratio_tensorized": float(report["compression_ratio_tensorized"]),
            "model_params": float(report["leftover_params"] + report["size"]),
            "peak_memory_bytes": _peak_memory_bytes(), "epoch": float(data.train.epoch)}


def maybe_compile(cfg: RunConfig, session: TrainSession) -> None:
    """``train.compile``: torch.compile the model forward inside the engine (DeepSpeed's
    ``engine.compile``). A prune rebuilds the engine around a new module, so it is compiled again;
    a stage switch changes only the objective outside the module (dynamo guards cover the rest).
    ``COMERA_COMPILE_BACKEND`` picks another torch.compile backend (tests use ``aot_eager``, which
    traces the same graphs without inductor's minutes-long C++ code generation on CPU).
    ``train.compile_mode`` goes to torch.compile as its ``mode``. ``train.compile_optimizer`` also compiles
    the ZeRO optimizer's ``step`` (default mode: its host reads split it into several graphs, which CUDA
    graphs could not replay).

    Dynamo's caches are reset first (``torch.compiler.reset``; the model is the process's only compiled
    code). A rebuilt engine's module is a new object, and the old module's cache entries, dead as they
    are, still count toward ``torch._dynamo.config.recompile_limit`` (8, and a module has a training and
    an evaluation graph): without the reset, a run that pruned five times went on eagerly from there, with
    one warning in its log."""
    if cfg.train.compile:
        torch.compiler.reset()
        backend = os.environ.get("COMERA_COMPILE_BACKEND", "inductor")
        session.engine.compile(backend=backend, compile_kwargs=compile_options(cfg))
        log.info("torch.compile (%s, mode %s): engine compiled = %s", backend, cfg.train.compile_mode,
                 session.engine.is_compiled)
        if cfg.train.compile_optimizer:
            optimizer = session.engine.optimizer  # DeepSpeedZeroOptimizer: the engine calls its step()
            # torch's fused AdamW is never traced (torch.compiler.disable'd inside), but its wrappers are, and they
            # guard on each group's learning rate: under a warmup every step re-traced them until Dynamo's
            # recompile limit. Kept out of the trace whole, the rest compiles once per parameter group.
            optimizer.optimizer.step = torch.compiler.disable(optimizer.optimizer.step)
            optimizer.step = torch.compile(optimizer.step, backend=backend, dynamic=False)
            log.info("torch.compile (%s): optimizer step of %s compiled", backend, type(optimizer).__name__)


def compile_options(cfg: RunConfig) -> dict[str, Any]:
    """``torch.compile``'s keyword arguments for ``train.compile``: ``train.compile_mode`` (none for
    ``default``), and static shapes. An evaluation's short last batch then compiles a graph of its own;
    with Dynamo's automatic dynamic shapes it made the batch dimension symbolic in every later graph of
    the module, the training graph included."""
    mode = cfg.train.compile_mode
    return {"dynamic": False} | ({} if mode == "default" else {"mode": mode})


def _format(values: dict[str, float]) -> str:
    keys = ("train_loss", "val_loss", "val_accuracy", "compression_ratio", "stage", "lambda", "tokens_per_second")
    return " ".join(f"{k} {values[k]:.4g}" for k in keys if k in values)


def _eta(elapsed_s: float, done: int, left: int) -> str:
    """``H:MM:SS`` left at the mean wall time per step so far (evaluations and checkpoints included)."""
    seconds = round(elapsed_s / max(done, 1) * left)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _setup_logging(info: DistInfo) -> None:
    logging.basicConfig(level=logging.INFO, force=True,
                        format=f"%(asctime)s [rank {info.rank}] %(levelname)s %(name)s: %(message)s")
    log.info("rank %d/%d up (local rank %d, %s discovery)", info.rank, info.world_size, info.local_rank,
             info.source)


def train(cfg: RunConfig, *, resume: str = "auto", stop: StopRequest | None = None) -> int:
    """Run the job described by ``cfg`` in this process (one rank); returns the exit status.

    A SIGUSR1 is recorded from the first line (``signals.START_SIGNALS``), or earlier through ``stop``
    (``comera pretrain`` watches before its imports): one that arrives while the job starts up
    (process group, data, model, resume: minutes for a large model) stops it at the first step
    boundary with a checkpoint, as one during training does. A ``stop`` passed in is the caller's to
    close."""
    own = stop is None
    stop = StopRequest(START_SIGNALS) if own else stop
    try:
        return _train(cfg, resume, stop)
    finally:
        if own:
            stop.close()  # the handlers the process had before (a USR1 during exit must not kill the rank)


def _train(cfg: RunConfig, resume: str, stop: StopRequest) -> int:
    check_pretrainable(cfg)  # before any rank starts a collective
    info = init_distributed(cfg.train.process_group_timeout_s)
    _setup_logging(info)
    check_world_size(cfg, info.world_size)  # batch arithmetic, now that the world size is known
    if info.rank == 0:
        for line in run_warnings(cfg):
            log.warning(line)
    check_device(accelerator_device())  # COMERA_KERNELS=triton where its kernels cannot run
    resume = _requeued(cfg, resume, info.rank)
    check_resume_path(resume)  # a mistyped path fails now, not after a data build of hours
    # rank 0 builds corpus + tokenizer (or keeps a resumed run's), the others wait; checks compat
    data = build_run_data(cfg, info, tokenizer_dir=resume_tokenizer_dir(Path(cfg.train.output_dir), resume))
    session = TrainSession.create(cfg, _model_factory(cfg), world_size=info.world_size)
    guard = NonFiniteGuard(limit=cfg.train.max_nonfinite_steps)
    start, resumed_from = _restore(session, data, guard, resume)
    if start >= cfg.train.steps:
        return _nothing_to_train(cfg, session, data, start, resumed_from, info.rank)
    faults = NonFiniteInjector(info.rank)
    faults.attach(session.module)  # after the resume: loading a pruned checkpoint rebuilds the module
    maybe_compile(cfg, session)
    if info.rank == 0:
        data.save_tokenizer(Path(cfg.train.output_dir) / "tokenizer")
    metrics = build_metrics(cfg.metrics, rank=info.rank, local_rank=info.local_rank,
                            world_size=info.world_size, total_steps=cfg.train.steps,
                            output_dir=cfg.train.output_dir, run_name=Path(cfg.train.output_dir).name,
                            nonfinite_steps_total=guard.total)  # a resume's restored total is no new skip
    if start:
        metrics.restore_history(start, resumed_from)  # the report covers the whole run
    stop.watch(STOP_SIGNALS)  # SIGTERM too, now that there is a state worth saving
    status, step = EXIT_OK, start
    failed = True  # until the loop ends with EXIT_OK: an exception on the way out is a failure too
    try:
        initial = _periodic_metrics(session, data)
        if start == 0:  # the starting point of the validation curve
            initial["val_loss"], initial["val_accuracy"] = session.evaluate(data.validation_batches())
            if info.rank == 0:
                log.info("step 0/%d %s", cfg.train.steps, _format(initial))
        metrics.log(initial, step)
        metrics.wait_for_first_scrape()  # rank 0; the others wait at the first step's collective
        loop_start = time.perf_counter()
        for step in range(start + 1, cfg.train.steps + 1):
            faults.arm(step)
            t0 = time.perf_counter()
            batches = data.next_train_batches()  # waits only when the loader's prefetch fell behind
            data_wait = time.perf_counter() - t0
            try:
                out = session.train_step(batches)
            except NonFiniteGradientsApplied as e:  # every rank: the gradient norm is global
                log.error("stopping without a checkpoint: %s; the latest checkpoint %s is kept", e,
                          latest_complete(session.checkpoint_root))
                status = EXIT_NONFINITE
                break
            # the step's kernels may still run (e.g. the optimizer's, when no host read follows them):
            # the step time ends when the device has finished the step
            get_accelerator().synchronize()
            step_time = time.perf_counter() - t0
            faults.arm(step, training=False)
            guard.update(out.skipped_nonfinite)
            values = _step_metrics(out, step_time, data_wait, data.tokens_per_step, guard)
            if out.skipped_nonfinite and info.rank == 0:
                log.warning("step %d: non-finite loss or gradients, step skipped (%d in a row, %d in total)",
                            step, guard.consecutive, guard.total)
            if session.maybe_prune(step):
                if info.rank == 0:
                    log.info("step %d: physical prune, engine rebuilt (total bond size %d)", step,
                             sum(sum(d) for d in session.bond_dims().values()))
                faults.attach(session.module)  # the rebuilt engine holds a new module
                maybe_compile(cfg, session)  # new shapes: trace the new module again
                metrics.log_ranks(session.ranks(), step)
                values.update(_periodic_metrics(session, data))
            elif step % cfg.train.log_every == 0:
                values.update(_periodic_metrics(session, data))
                metrics.log_ranks(session.ranks(), step)
            if _due(step, cfg.train.eval_every, cfg.train.steps):
                values["val_loss"], values["val_accuracy"] = session.evaluate(data.validation_batches())
            metrics.log(values, step)
            if info.rank == 0 and (step % cfg.train.log_every == 0 or "val_loss" in values):
                log.info("step %d/%d %s eta %s", step, cfg.train.steps, _format(values),
                         _eta(time.perf_counter() - loop_start, step - start, cfg.train.steps - step))
            if guard.tripped:
                _stop_nonfinite(session, data, step, guard, metrics, rank=info.rank)
                status = EXIT_NONFINITE
                break
            if stop.agree():
                log.warning("stop requested (%s): checkpointing at step %d", stop.signal_name or "peer", step)
                _checkpoint(session, data, step, guard, metrics, reason="signal")
                break
            if _due(step, cfg.train.checkpoint_every, cfg.train.steps):
                _checkpoint(session, data, step, guard, metrics, reason="schedule")
        failed = status != EXIT_OK
    except RanksCollapsed as e:  # on every rank at the same step: S and the ranks are global
        log.error("step %d: stopping without a checkpoint: %s. The latest checkpoint %s is kept", step, e,
                  latest_complete(session.checkpoint_root))
        status = EXIT_COLLAPSED
    finally:
        metrics.close(failed=failed)  # the report; a stop signal meanwhile only sets the flag
        data.train.close()  # the prefetch thread, which an in-process caller (bench soak) would keep
    # Leave together: a launcher tears the whole job down as soon as one rank exits non-zero, which
    # would kill rank 0 in the middle of writing the report.
    tdist.barrier()
    session.close()
    return status


def _nothing_to_train(cfg: RunConfig, session: TrainSession, data: RunData, start: int, resumed_from: Path | None,
                      rank: int) -> int:
    """A resume at or past ``train.steps`` (a finished run started again, or a requeue of one): done, exit 0, and
    said, with nothing written (no metrics, report or checkpoint: the run's own stand)."""
    if rank == 0:
        log.warning("nothing to train: %s is at step %d and train.steps=%d; raise train.steps (--set "
                    "train.steps=N) to train on", resumed_from, start, cfg.train.steps)
    data.train.close()
    tdist.barrier()
    session.close()
    return EXIT_OK


def _due(step: int, every: int, last: int) -> bool:
    """True at multiples of ``every`` (0 = never) and at the last step."""
    return step == last or (every > 0 and step % every == 0)
