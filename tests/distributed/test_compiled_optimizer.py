"""``train.compile_optimizer`` on 2 real ranks (torchrun, CPU, gloo): DeepSpeed's ZeRO-1 optimizer step compiled
by torch.compile, its all-reduces and the bf16 copy back included, applies the same updates as the eager step."""

from __future__ import annotations

import pytest
import test_launchers as tl
import torch
from test_launchers import job_env, run_overrides

from comera_dist.engine.checkpoint import tag_for
from comera_dist.engine.ports import free_port

jobs = tl.jobs  # the job-starting fixture (tears every process tree down)


def _weights(out, step: int) -> dict[str, torch.Tensor]:
    path = out / "checkpoints" / tag_for(step) / "mp_rank_00_model_states.pt"
    return torch.load(path, map_location="cpu", weights_only=False)["module"]


@pytest.mark.distributed
def test_compiled_zero1_optimizer_step_matches_the_eager_one_on_two_ranks(jobs, tmp_path, port):
    """bf16 at ZeRO 1 (the trainer's GPU configuration), the model compiled either way (aot_eager), a NaN loss
    on rank 0 at step 2 (ZeRO's overflow check skips the step: the compiled step's other branch), a learning
    rate that changes at every step (warmup): after 6 steps, the late stage included, every weight of the
    compiled-optimizer run equals the eager-optimizer run's bit for bit, both ranks say they compiled the step,
    and Dynamo never hit its recompile limit."""
    runs = {}
    for i, (name, extra) in enumerate((("eager", ()), ("compiled", ("train.compile_optimizer=true",)))):
        out = tmp_path / name
        args = run_overrides(out, "train.steps=6", "train.checkpoint_every=6", "train.eval_every=0",
                             "deepspeed.scheduler.kind=warmup_decay", "deepspeed.scheduler.warmup_steps=10",
                             "deepspeed.precision=bf16", "deepspeed.zero_stage=1", "comera.pruning.every=0",
                             "comera.controller.late_stage_step=2", "train.compile=true", *extra)
        env = job_env(port if i == 0 else free_port(), COMERA_COMPILE_BACKEND="aot_eager",
                      COMERA_FAULT_NONFINITE_STEPS="2", COMERA_FAULT_RANKS="0")
        job = jobs("torchrun", args, env, tmp_path / f"{name}.log")
        assert job.wait(timeout=300) == 0, job.text()[-4000:]
        runs[name] = (out, job.text())
        assert "step 2: non-finite loss or gradients, step skipped (1 in a row, 1 in total)" in runs[name][1]
    said = "torch.compile (aot_eager): optimizer step of DeepSpeedZeroOptimizer compiled"
    assert runs["compiled"][1].count(said) == 2 and said not in runs["eager"][1]  # once per rank
    # the learning rate changes at every step of the warmup: the compiled step must not re-trace for it
    assert "recompile_limit" not in runs["compiled"][1], runs["compiled"][1][-4000:]
    eager, compiled = _weights(runs["eager"][0], 6), _weights(runs["compiled"][0], 6)
    assert compiled.keys() == eager.keys()
    for name, t in eager.items():
        assert torch.equal(compiled[name], t), name
