"""Checkpoints through the real training job on real ranks: the non-finite stop (``engine.trainer.train``),
and a 2-rank run resumed on 1 rank at another ZeRO stage (``comera pretrain``'s entry point, which also
leaves the process group once the job is done).

Non-finite stop:

1. NaN losses (fault injection) with finite weights: the stop writes its checkpoint without
   retention, so every earlier checkpoint stays, and says which one is kept.
2. The issue's sequence: a run resumes from a checkpoint whose weights are NaN (written before
   manifests existed, so it cannot be verified); every loss is non-finite and the stop trips. The
   poisoned state is never written as "last good", nothing is deleted, and the log says so.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import pytest
import torch
from dist_helpers import LogLines, run_ranks

from comera_dist import cli
from comera_dist.engine.checkpoint import tag_for

REPO = Path(__file__).resolve().parents[2]
CACHE = os.environ.get("COMERA_TEST_CACHE", str(Path(tempfile.gettempdir()) / "comera-dist-test-cache"))


def _train(rank: int, world_size: int, outdir: str, steps: int, fault: str = "") -> dict:
    os.environ.update(COMERA_FAULT_NONFINITE_STEPS=fault, COMERA_CACHE=CACHE, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                      TOKENIZERS_PARALLELISM="false")
    from comera_dist.config import load_run_config
    from comera_dist.engine.trainer import train

    records = LogLines(logging.INFO)
    for name in ("comera_dist.engine.session", "comera_dist.engine.resume", "comera_dist.engine.trainer",
                 "comera_dist.engine.checkpoint"):
        logging.getLogger(name).addHandler(records)
    cfg = load_run_config(REPO / "configs/tiny-cpu.yaml", [
        f"train.output_dir={outdir}", f"train.steps={steps}", "train.checkpoint_every=2", "train.eval_every=0",
        "train.keep_checkpoints=2", "deepspeed.zero_stage=0", "comera.pruning.every=0",
        "metrics.prometheus=false", "metrics.report=false"])
    status = train(cfg, resume="auto")
    return {"status": status, "log": records.lines}


@pytest.mark.parametrize("poisoned", [(".core",), (".core", ".gate")], ids=["cores", "cores-and-gates"])
def test_nonfinite_stop_keeps_previous_and_never_writes_poisoned_state(tmp_path, poisoned):
    """With NaN gates too, S reads 0 (NaN is not above tau): that is a non-finite state (exit 3), not a collapse of
    the ranks (exit 4, whose message points at the rank penalty's settings)."""
    out = tmp_path / "run"
    root = out / "checkpoints"
    run_ranks(_train, tmp_path / "w1", str(out), 4)  # checkpoints at steps 2 and 4 (keep_checkpoints=2)

    # 1. Losses of steps 5-7 are NaN (weights untouched, so step 6 is saved as scheduled, and retention
    # removes step 2): the stop at 7 writes the finite state and deletes nothing.
    stopped = run_ranks(_train, tmp_path / "w2", str(out), 12, "5-7")
    assert [r["status"] for r in stopped] == [3, 3]
    log = stopped[0]["log"]
    assert any(f"wrote {root / tag_for(7)}; the previous checkpoint {root / tag_for(6)} is kept" in line
               for line in log), log
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step")) == [tag_for(s) for s in (4, 6, 7)]

    # 2. Poison step 7 the way an old, unverifiable checkpoint could be: NaN weights, pre-manifest marker.
    step7 = root / tag_for(7)
    shard = step7 / "mp_rank_00_model_states.pt"
    state = torch.load(shard, map_location="cpu", weights_only=False)
    for name, t in state["module"].items():
        if t.is_floating_point() and name.endswith(poisoned):  # every layer's flat cores (and gates)
            t.fill_(float("nan"))
    gates = [t for name, t in state["module"].items() if name.endswith(".gate")]
    assert gates and all(bool(t.isnan().all()) for t in gates) is (".gate" in poisoned)
    torch.save(state, shard)
    (step7 / "COMPLETE").write_text(f"{tag_for(7)}\n")
    results = run_ranks(_train, tmp_path / "w3", str(out), 12)
    for r in results:
        assert r["status"] == 3, r["log"][-10:]
    log = results[0]["log"]
    assert any("written before checkpoint manifests" in line for line in log), log
    assert any("stopping: 3 consecutive non-finite steps" in line for line in log), log
    assert any("rank gates are not finite" in line for line in log) is (".gate" in poisoned), log
    refused = [line for line in log if "not checkpointing" in line]  # the scheduled save at 8, the stop at 10
    assert [line.split(":")[0] for line in refused] == ["step 8", "step 10"], log
    assert "non-finite" in refused[1] and ".core," in refused[1], log
    assert any(f"nothing written; the previous checkpoint {step7} is kept" in line for line in log), log
    # Nothing was written, and nothing was deleted.
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step")) == [tag_for(s) for s in (4, 6, 7)]
    assert (root / "latest").read_text() == tag_for(7)


def _resume_job(rank: int, world_size: int, outdir: str, steps: int, stage: int, *sets: str) -> dict:
    """The job as users start it: ``comera pretrain`` (``cli.pretrain_main``) on this rank."""
    os.environ.update(COMERA_CACHE=CACHE, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                      TOKENIZERS_PARALLELISM="false", COMERA_FAULT_NONFINITE_STEPS="")
    from comera_dist.cli import pretrain_main

    records = LogLines(logging.INFO)
    for name in ("comera_dist.engine.session", "comera_dist.engine.resume", "comera_dist.engine.trainer"):
        logging.getLogger(name).addHandler(records)
    overrides = [
        f"train.output_dir={outdir}", f"train.steps={steps}", "train.checkpoint_every=3", "train.eval_every=0",
        f"deepspeed.zero_stage={stage}", "deepspeed.train_batch_size=8", "deepspeed.micro_batch_size_per_gpu=4",
        "deepspeed.gradient_accumulation_steps=null", "metrics.prometheus=false", "metrics.report=false", *sets]
    argv = ["--config", str(REPO / "configs/tiny-cpu.yaml"), "--resume", "auto"]
    status = pretrain_main(argv + [a for o in overrides for a in ("--set", o)])
    # a finished job leaves its process group itself, not to interpreter exit (engine.distributed.leave_distributed),
    # and nothing keeps its engine (with the groups its optimizer holds) alive until then
    import gc

    import deepspeed

    engines = sum(isinstance(o, deepspeed.DeepSpeedEngine) for o in gc.get_objects())
    return {"status": status, "log": records.lines, "group_left": not torch.distributed.is_initialized(),
            "engines_alive": engines}


def test_trainer_resumes_a_two_rank_run_on_one_rank_at_zero3(tmp_path, capsys):
    """The README's job, requeued on fewer ranks and another ZeRO stage: no manual step, same global batch."""
    out = tmp_path / "run"
    first = run_ranks(_resume_job, tmp_path / "w1", str(out), 3, 1)
    assert [r["status"] for r in first] == [0, 0]
    assert all(r["group_left"] and r["engines_alive"] == 0 for r in first), first[0]["engines_alive"]

    # --check-config reads the checkpoint a resume would load: the run's config fits it, another tensorization not
    check = ["pretrain", "--config", str(REPO / "configs/tiny-cpu.yaml"), "--set", f"train.output_dir={out}",
             "--check-config"]
    assert cli.main(check) == 0
    assert f"resumes {out / 'checkpoints' / tag_for(3)} if it verifies" in capsys.readouterr().out
    assert cli.main([*check, "--set", "comera.tensorize.max_rank=6"]) == cli.EXIT_BAD_INPUT
    assert "tensorize.max_rank: checkpoint 8 vs config 6" in capsys.readouterr().err
    [again] = run_ranks(_resume_job, tmp_path / "w2", str(out), 6, 3, world_size=1)
    assert again["status"] == 0 and again["group_left"], again["log"][-10:]
    # nor at ZeRO 3, whose module-level references DeepSpeed's destroy() leaves (engine.build.destroy)
    assert again["engines_alive"] == 0, again["engines_alive"]
    log = again["log"]
    assert any("elastic resume from" in line and "2 rank(s) at ZeRO 1 -> 1 rank(s) at ZeRO 3" in line
               for line in log), log
    assert "resumed at step 3" in log and any(line.startswith("step 6/6") for line in log), log
    assert (out / "checkpoints" / "latest").read_text() == tag_for(6)

    # Started again with train.steps below the run's step: done, said so, nothing written. Its warmup outlasts
    # the run, which rank 0 says at the start; so does a late_stage_step after the switch the checkpoint made.
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    [done] = run_ranks(_resume_job, tmp_path / "w3", str(out), 4, 3, "deepspeed.scheduler.kind=warmup_decay",
                       "deepspeed.scheduler.warmup_steps=5", "comera.controller.late_stage_step=10", world_size=1)
    assert done["status"] == 0 and done["group_left"], done["log"][-10:]
    ck6 = out / "checkpoints" / tag_for(6)
    assert f"nothing to train: {ck6} is at step 6 and train.steps=4; raise train.steps (--set train.steps=N) to " \
           "train on" in done["log"], done["log"]
    assert any(line.startswith("deepspeed.scheduler.warmup_steps=5 exceeds train.steps=4: the learning rate rises for the "
                               "whole run, to about 80% of its peak") for line in done["log"]), done["log"]
    assert any(line.startswith("resume: the checkpoint's controller entered the late stage at step 4 and stays "
                               "there: this config's comera.controller.late_stage_step is 10") for line in done["log"])
    assert not any(line.startswith("step ") for line in done["log"]), done["log"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == saved
    assert (out / "checkpoints" / "latest").read_text() == tag_for(6)


def _usr1_before_train_job(rank: int, world_size: int, outdir: str) -> dict:
    """``comera pretrain`` on this rank; rank 1 gets Slurm's SIGUSR1 while it loads its config, after the
    entry point began and before ``train()`` runs (the window of torch's and DeepSpeed's imports)."""
    import signal

    from comera_dist import config

    real = config.load_run_config

    def load_and_warn(*a, **k):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)  # Python's default: the rank dies of it (-10)
        return real(*a, **k)

    config.load_run_config = load_and_warn
    return _resume_job(rank, world_size, outdir, 50, 1)


def test_sigusr1_before_train_stops_the_job_at_its_first_step(tmp_path):
    out = tmp_path / "run"
    results = run_ranks(_usr1_before_train_job, tmp_path / "w", str(out))
    assert [r["status"] for r in results] == [0, 0], results[1]["log"][-10:]
    assert "stop requested (SIGUSR1): checkpointing at step 1" in results[1]["log"], results[1]["log"]
    log = results[0]["log"]
    assert "stop requested (peer): checkpointing at step 1" in log, log[-10:]  # rank 0 learns it from rank 1
    assert not any(line.startswith("step 2/") for line in log), log
    assert (out / "checkpoints" / "latest").read_text() == tag_for(1)
