"""Failure handling of real 2-rank jobs (torchrun, CPU):

* non-finite losses (injected through the documented COMERA_FAULT_* hook, on rank 0 only) are
  skipped on every rank, counted and logged; K consecutive ones stop the run with exit 3 and a
  checkpoint whose weights are the last good ones;
* a rank penalty that kills every rank (S = 0) stops the run with exit 4 and no checkpoint of the dead model;
* SIGUSR1 to one rank (Slurm's preemption warning) checkpoints at the next step boundary on every
  rank, exits 0, and ``--resume auto`` continues from that step; one that arrives while the job is
  still starting up does the same at the first step.
"""

from __future__ import annotations

import json
import re
import signal

import pytest
import test_launchers as tl
import torch
from test_launchers import checkpoint_tags, job_env, rank_processes, run_overrides

from comera_dist.engine.checkpoint import tag_for
from comera_dist.engine.ports import free_port

jobs = tl.jobs  # the job-starting fixture (tears every process tree down)


def _model_states(tag_dir) -> dict:
    files = sorted(tag_dir.rglob("mp_rank_00_model_states.pt"))
    assert files, f"no model states under {tag_dir}"
    return torch.load(files[0], map_location="cpu", weights_only=False)


@pytest.mark.distributed
def test_unchecked_bf16_nonfinite_gradients_stop_the_run_without_a_checkpoint(jobs, tmp_path, port):
    """bf16 at ZeRO 1 with deepspeed.bf16_overflow_check=false: NaN gradients under a finite loss (rank 0,
    step 3) are applied, so every rank stops with exit 3, names the knob and writes nothing after step 2."""
    out = tmp_path / "run"
    env = job_env(port, COMERA_FAULT_NONFINITE_STEPS="3", COMERA_FAULT_RANKS="0", COMERA_FAULT_NONFINITE_KIND="grad")
    args = run_overrides(out, "train.steps=6", "train.checkpoint_every=2", "deepspeed.precision=bf16",
                         "deepspeed.zero_stage=1", "deepspeed.bf16_overflow_check=false", "comera.pruning.every=0")
    job = jobs("torchrun", args, env, tmp_path / "job.log")
    rc = job.wait(timeout=240)
    log = job.text()
    assert rc == 3 and re.search(r"exitcode\s*:\s*3", log), f"expected ranks to exit 3 (rc {rc}):\n{log[-4000:]}"
    assert "stopping without a checkpoint: step 3: the gradients were not finite" in log, log[-4000:]
    assert "deepspeed.bf16_overflow_check=false" in log and "step 4/" not in log
    assert checkpoint_tags(out) == [tag_for(2)]  # the corrupt state was never saved


@pytest.mark.distributed
def test_nonfinite_steps_skipped_counted_then_stop(jobs, tmp_path, port):
    out = tmp_path / "run"
    # Step 2 alone, then 4, 5, 6 in a row: K = 3 trips at step 6. Pruning off so that the
    # checkpoint at step 3 and the stop checkpoint at step 6 hold comparable tensors.
    env = job_env(port, COMERA_FAULT_NONFINITE_STEPS="2,4-6", COMERA_FAULT_RANKS="0")
    sd = tmp_path / "targets.json"
    args = run_overrides(out, "train.steps=10", "train.checkpoint_every=3", "train.max_nonfinite_steps=3",
                         "train.keep_checkpoints=5", "comera.pruning.every=0", "metrics.prometheus=true",
                         f"metrics.sd_file={sd}")
    job = jobs("torchrun", args, env, tmp_path / "job.log")
    rc = job.wait(timeout=240)
    log = job.text()
    # Every rank exits 3; torchrun reports a failed job (exit 1) with the ranks' codes.
    assert rc == 3 and re.search(r"exitcode\s*:\s*3", log), f"expected ranks to exit 3 (rc {rc}):\n{log[-4000:]}"
    # a failed run is not withdrawn like a finished one: its dead target stays for Prometheus to alert on
    assert [g["labels"]["run"] for g in json.loads(sd.read_text())] == ["run"], sd.read_text()
    assert "step 2: non-finite loss or gradients, step skipped (1 in a row, 1 in total)" in log, log[-4000:]
    assert "step 6: non-finite loss or gradients, step skipped (3 in a row, 4 in total)" in log, log[-4000:]
    assert "stopping: 3 consecutive non-finite steps" in log
    assert "step 7/" not in log  # it stopped
    tags = checkpoint_tags(out)
    assert {tag_for(3), tag_for(6)} <= set(tags), tags
    assert (out / "checkpoints" / "latest").read_text().strip() == tag_for(6)
    before = _model_states(out / "checkpoints" / tag_for(3))
    after = _model_states(out / "checkpoints" / tag_for(6))
    for client in after["clients"]:  # every rank's client state
        assert client["reason"] == "nonfinite" and client["nonfinite_steps_total"] == 4
    # Steps 4-6 were skipped on both ranks (the poison was on rank 0 only): the weights at the stop
    # are bitwise the weights after step 3, the last good step.
    assert before["module"].keys() == after["module"].keys()
    for name, t in before["module"].items():
        assert torch.equal(t, after["module"][name]), name


@pytest.mark.distributed
@pytest.mark.parametrize("log_every, checkpoint_every", [(1, 0), (100, 1)])
def test_every_rank_dead_stops_the_run_with_exit_4_before_a_checkpoint_of_it(jobs, tmp_path, port, log_every,
                                                                            checkpoint_every):
    """A rank penalty 1e5 times the default with a gate lr of 0.5 drives every gate under tau within a few
    steps: every rank stops with exit 4 at the first step that reads S = 0, names the knobs, and no checkpoint
    holds the dead model. Each case has one read: a logging step's without checkpoints, or with logs rarer than
    checkpoints the checkpoint's own check (one due at every step)."""
    out = tmp_path / "run"
    sd = tmp_path / "targets.json"
    args = run_overrides(out, "train.steps=12", f"train.checkpoint_every={checkpoint_every}", f"train.log_every={log_every}",
                         "train.keep_checkpoints=20", "comera.controller.gamma=1000", "comera.lr.gates=0.5",
                         "comera.controller.late_stage_step=10", "comera.pruning.every=0", "metrics.prometheus=true",
                         f"metrics.sd_file={sd}")
    job = jobs("torchrun", args, job_env(port), tmp_path / "job.log")
    rc = job.wait(timeout=240)
    log = job.text()
    assert rc == 4 and re.search(r"exitcode\s*:\s*4", log), f"expected ranks to exit 4 (rc {rc}):\n{log[-4000:]}"
    assert [g["labels"]["run"] for g in json.loads(sd.read_text())] == ["run"], sd.read_text()  # left down: alerts
    stopped = re.search(r"step (\d+): stopping without a checkpoint: every rank of every TT layer is dead", log)
    assert stopped, log[-4000:]
    step = int(stopped.group(1))
    assert "comera.controller.gamma" in log and "comera.lr.gates" in log
    assert f"step {step + 1}/" not in log and step < 10  # found by a read of S (logging or checkpoint), before the switch
    tags = checkpoint_tags(out)
    assert tags == [tag_for(s) for s in range(1, step) if checkpoint_every], tags  # each due before the collapse


@pytest.mark.distributed
def test_sigusr1_checkpoints_exits_zero_and_resumes(jobs, tmp_path, port):
    out = tmp_path / "run"
    sd = tmp_path / "targets.json"
    args = run_overrides(out, "train.steps=200", "train.checkpoint_every=0", "train.log_every=1",
                         "comera.pruning.every=0", "metrics.prometheus=true", f"metrics.sd_file={sd}")
    job = jobs("torchrun", args, job_env(port), tmp_path / "job.log")
    job.wait_for(r"step 3/200", timeout=180)
    assert [g["labels"]["run"] for g in json.loads(sd.read_text())] == ["run"], sd.read_text()
    rank_processes(job)[1].send_signal(signal.SIGUSR1)  # one rank only: the others must agree
    rc = job.wait(timeout=90)
    log = job.text()
    assert rc == 0, log[-4000:]
    assert json.loads(sd.read_text()) == []  # a clean stop (to be requeued) withdraws its target
    stopped = re.search(r"stop requested \((SIGUSR1|peer)\): checkpointing at step (\d+)", log)
    assert stopped, log[-4000:]
    step = int(stopped.group(2))
    assert 3 <= step < 200
    assert f"step {step + 1}/200" not in log

    # The requeued job: --resume auto continues after the saved step and finishes.
    resumed = jobs("torchrun", [*run_overrides(out, f"train.steps={step + 2}", "comera.pruning.every=0",
                                               "train.log_every=1"), "--resume", "auto"],
                   job_env(free_port()), tmp_path / "resume.log")
    rc = resumed.wait(timeout=180)
    log2 = resumed.text()
    assert rc == 0, log2[-4000:]
    assert f"resumed at step {step}" in log2, log2[-4000:]
    assert f"step {step + 1}/{step + 2}" in log2 and f"step {step}/" not in log2


@pytest.mark.distributed
def test_sigusr1_during_start_up_stops_at_the_first_step(jobs, tmp_path, port):
    """The warning reaches a rank after its process group is up, while data, model and engine are still
    being built: the rank keeps it (``signals.START_SIGNALS``) instead of dying of it, and the job
    checkpoints at step 1 and exits 0, so Slurm requeues it."""
    out = tmp_path / "run"
    args = run_overrides(out, "train.steps=200", "train.checkpoint_every=0", "train.log_every=1",
                         "comera.pruning.every=0")
    job = jobs("torchrun", args, job_env(port), tmp_path / "job.log")
    job.wait_for(r"rank 1/2 up", timeout=180)  # logged right after the process group starts
    rank_processes(job)[1].send_signal(signal.SIGUSR1)
    rc = job.wait(timeout=180)
    log = job.text()
    assert rc == 0, log[-4000:]
    assert "stop requested (SIGUSR1): checkpointing at step 1" in log, log[-4000:]
    assert "step 2/200" not in log
    assert checkpoint_tags(out) == [tag_for(1)]
