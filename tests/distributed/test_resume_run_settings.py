"""A resume applies its own config's gate thresholds, its target ratio, its weight decay and, without an LR
scheduler, its lrs.

All came back from the checkpoint before: a layer's ``tau`` is a state-dict buffer, DeepSpeed's load restores the
writing run's param groups (a scheduler then re-sets the lrs from the resuming config, a constant schedule did not),
and the late stage's target size S* was the writing run's ``target_ratio`` times S at the switch. So a run that
collapsed and was resumed with a lower ``comera.controller.tau`` or ``comera.lr.gates``, as the collapse message says
to, went on with the old values. Two real ranks, through DeepSpeed's own load (same world size and stage) and
through the consolidated state (ZeRO 2, and ZeRO 3, whose rank penalty is the hook's and reads its taus); a resume
with the writing config changes nothing. With a scheduler (``warmup_decay``, the default) the weight decay is the
resuming config's through either load, as the elastic one always had it; DeepSpeed's own kept the writing run's.
A scheduler added on resume (the checkpoint written with ``constant``) starts at the run's step.
"""

from __future__ import annotations

import math

import pytest
from dist_helpers import run_ranks
from engine_cases import batch, tiny_config, with_overrides

WRITTEN = ["comera.controller.tau=0.5", "comera.lr.gates=0.05", "comera.controller.late_stage_step=1",
           "comera.controller.target_ratio=0.5"]
RESUMED = [*WRITTEN[:-1], "comera.controller.tau=0.3", "comera.controller.embedding_tau=0.2", "comera.lr.gates=0.02",
           "comera.lr.weight_decay=0.01", "comera.controller.target_ratio=0.25"]
SCHEDULED = ["deepspeed.scheduler.kind=warmup_decay", "train.steps=10"]


def _config(outdir: str, overrides: list[str], zero_stage: int):
    return with_overrides(tiny_config(outdir, zero_stage=zero_stage), overrides)


def _settings(session) -> dict:
    from comera_dist.compression.walk import tensorized_modules

    return {"tau": {name: round(float(layer.tau), 6) for name, layer in tensorized_modules(session.module)},
            "penalty_tau": sorted({round(ref.tau, 6) for ref in session.penalty.gates}),
            "groups": {g["name"]: (g["lr"], g["weight_decay"]) for g in session.engine.optimizer.param_groups},
            "switch": (session.controller.state.size_at_switch, session.controller.state.target_size)}


def _session(outdir: str, overrides: list[str], stage: int, world_size: int, *, resume: bool):
    from comera_dist.engine.model_factory import build_run_model
    from comera_dist.engine.session import TrainSession

    cfg = _config(outdir, overrides, stage)
    s = TrainSession.create(cfg, lambda: build_run_model(cfg), world_size=world_size)
    if resume:
        s.resume("auto")
    return s


def _write(outdir: str, overrides: list[str], steps: int, rank: int, world_size: int) -> dict:
    """Train ``steps`` steps at ZeRO 1 and checkpoint them; the settings the writing session had."""
    s = _session(outdir, overrides, 1, world_size, resume=False)
    for i in range(1, steps + 1):
        s.train_step([batch(i, rank)])
    written = _settings(s)
    s.save(steps)
    s.close()
    return written


def _groups(s) -> dict:
    return {g["name"]: (g["lr"], g["weight_decay"]) for g in s.engine.optimizer.param_groups}


def _run(rank: int, world_size: int, outdir: str) -> dict:
    from comera_dist.engine.distributed import init_distributed

    init_distributed(60)
    out = {"written": _write(outdir, WRITTEN, 1, rank, world_size)}
    for name, overrides, stage in (("same", WRITTEN, 1), ("changed", RESUMED, 1), ("changed_elastic", RESUMED, 2),
                                   ("changed_zero3", RESUMED, 3)):
        s = _session(outdir, overrides, stage, world_size, resume=True)
        out[name] = _settings(s)
        out[name]["loss"] = s.train_step([batch(2, rank)]).task_loss  # the resumed session trains
        s.close()
    scheduled = outdir + "-scheduled"
    _write(scheduled, SCHEDULED, 5, rank, world_size)
    for name, stage in (("scheduled", 1), ("scheduled_elastic", 2)):
        s = _session(scheduled, [*SCHEDULED, "comera.lr.weight_decay=0.05"], stage, world_size, resume=True)
        out[name] = _groups(s)
        s.close()
    constant = outdir + "-constant"  # the same 5 steps without a scheduler, resumed with one
    _write(constant, ["train.steps=10"], 5, rank, world_size)
    for name, stage in (("scheduler_added", 1), ("scheduler_added_elastic", 2)):
        s = _session(constant, SCHEDULED, stage, world_size, resume=True)
        out[name] = {role: lr for role, (lr, _) in _groups(s).items()}
        out[name]["loss"] = s.train_step([batch(6, rank)]).task_loss
        s.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run-settings")
    return run_ranks(_run, tmp / "w", str(tmp / "run"))


def test_a_resume_with_the_writing_config_changes_nothing(results):
    for out in results:
        assert set(out["written"]["tau"].values()) == {0.5} and out["written"]["penalty_tau"] == [0.5]
        assert out["written"]["groups"]["gates"] == (0.05, 0.0)
        assert {k: v for k, v in out["same"].items() if k != "loss"} == out["written"]


@pytest.mark.parametrize("case", ["changed", "changed_elastic", "changed_zero3"])
def test_a_resume_takes_its_own_thresholds_and_lrs(results, case):
    for out in results:
        got = out[case]
        assert got["tau"].pop("embeddings.word") == 0.2
        assert set(got["tau"].values()) == {0.3}, got["tau"]
        assert got["penalty_tau"] == [0.2, 0.3]  # R's surviving set uses them too
        assert got["groups"] == {"cores": (1e-2, 0.01), "gates": (0.02, 0.0), "dense": (1e-2, 0.01)}
        size = out["written"]["switch"][0]  # S at the switch (step 1), S* from the resuming ratio
        assert out["written"]["switch"] == (size, 0.5 * size) and got["switch"] == (size, 0.25 * size)
    loss = results[0][case]["loss"]
    assert math.isfinite(loss) and results[1][case]["loss"] == loss  # the global loss, on both ranks


def test_a_scheduled_resume_takes_its_own_weight_decay_through_either_load(results):
    for out in results:
        same, elastic = out["scheduled"], out["scheduled_elastic"]
        assert {name: wd for name, (_, wd) in same.items()} == {"cores": 0.05, "gates": 0.0, "dense": 0.05}, same
        assert same == elastic  # the lrs too: the scheduler's at step 5, from the same config
        assert same["cores"][0] < 1e-2, same  # past the warmup, decaying: the scheduler set the lrs


@pytest.mark.parametrize("case", ["scheduler_added", "scheduler_added_elastic"])
def test_a_scheduler_added_on_resume_starts_at_the_runs_step(results, case):
    """A checkpoint written without a scheduler holds no scheduler state: DeepSpeed's own load failed on it with a
    TypeError, and the elastic one started the schedule over at its warmup. Through either, the resuming run's
    scheduler is where it would be had it run from the start: the lrs of the scheduled run at the same step."""
    for out in results:
        got = dict(out[case])
        loss = got.pop("loss")
        assert got == {name: lr for name, (lr, _) in out["scheduled"].items()}, (got, out["scheduled"])
        assert got["cores"] < 1e-2 and math.isfinite(loss), got  # not the constant run's lr
