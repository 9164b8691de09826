"""Prune-and-rebuild (ZeRO 0, 1, 3), sharded resume and atomic saves at ZeRO 1 and 3; non-finite skips, LR warmup, bf16.

All on 2 real ranks.

Dead ranks are made explicitly: two gate entries of one layer are set far below tau in the fp32
master state (``safe_set_full_fp32_param``); the mask then zeroes their gradients, so they stay
dead, and the next scheduled prune must slice them out of the cores on every rank.
"""

from __future__ import annotations

import math
import os
import signal
from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks
from engine_cases import (
    assert_same_training,
    batch,
    factory,
    full_params,
    kill_two_ranks,
    knob_runs,
    tiny_config,
)

from comera_dist.layers.base import split_flat

LAYER, BOND = "blocks.0.attn.query", 1


def _session(outdir: str, stage: int, *, late_stage_step: int = 3, dropout: float = 0.0, **kw):
    from comera_dist.engine.session import TrainSession

    kw.setdefault("scheduler", {"kind": "warmup_cosine", "warmup_steps": 2})
    cfg = tiny_config(outdir, zero_stage=stage, steps=4, prune_every=2, late_stage_step=late_stage_step,
                      dropout=dropout, **kw)
    return TrainSession.create(cfg, factory(cfg), world_size=2)


def _prune_case(rank: int, world_size: int, outdir: str) -> dict:
    import gc

    import deepspeed

    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.prune import gather_full_state

    init_distributed(60)
    out = {}
    for stage in (0, 1, 3):
        s = _session(f"{outdir}/z{stage}", stage)
        kill_two_ranks(s, LAYER, BOND)
        s.train_step([batch(1, rank)])
        s.train_step([batch(2, rank)])
        probe = [batch(99, rank)]
        before_loss = s.evaluate(probe)
        before_state = gather_full_state(s.engine)
        dims_before = s.bond_dims()
        shapes_before = dict(s.module.named_modules())[LAYER].core_shapes()
        pruned = s.maybe_prune(2)
        gc.collect()
        alive = sum(isinstance(o, deepspeed.DeepSpeedEngine) for o in gc.get_objects())  # the old one is gone
        after_state = gather_full_state(s.engine)
        out[stage] = {"pruned": pruned, "dims_before": dims_before, "dims_after": s.bond_dims(), "alive": alive,
                      "shapes_before": shapes_before,
                      "shapes_after": dict(s.module.named_modules())[LAYER].core_shapes(),
                      "before": before_loss, "after": s.evaluate(probe),
                      "moments_before": before_state.moments, "moments_after": after_state.moments,
                      "step_before": before_state.step, "step_after": after_state.step,
                      "next": s.train_step([batch(3, rank)]).task_loss,
                      "local_shapes": {n: tuple(p.shape) for n, p in s.module.named_parameters()}}
        s.close()
    out.update(_features(rank, world_size, outdir))
    out["bf16-check"] = _bf16_check_cases(rank, world_size, outdir)
    out["contiguous"] = _contiguous_cases(rank, world_size, outdir)
    return out


def _contiguous_cases(rank: int, world_size: int, outdir: str) -> dict:
    """Three steps with and without ``deepspeed.contiguous_gradients`` (ZeRO 1 bf16, ZeRO 2 fp32 with
    two micro-batches): the losses and the final weights, and what DeepSpeed was told."""
    return knob_runs(outdir, rank, world_size, "contiguous_gradients",
                     lambda s: {"told": s.engine.zero_contiguous_gradients(),
                                "engine": s.engine.optimizer.contiguous_gradients})


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory):
    """One 2-rank job for the prune and the feature tests (process start-up dominates their cost)."""
    tmp = tmp_path_factory.mktemp("short")
    return run_ranks(_prune_case, tmp / "work", str(tmp / "runs"))


def test_prune_and_rebuild_zero0_zero1_zero3(short_runs):
    """Prune at ZeRO 0, 1 and 3: shapes shrink on every rank, loss continuous, Adam moments carried over
    (at ZeRO 0 into torch's own AdamW state, which DeepSpeed does not partition)."""
    results = short_runs
    for stage in (0, 1, 3):
        for rank in (0, 1):
            r = results[rank][stage]
            assert r["pruned"], f"z{stage} rank {rank}: no prune happened"
            assert r["alive"] == 1, r["alive"]  # the rebuilt engine only (at ZeRO 3: engine.build.destroy)
            assert r["dims_before"][LAYER] == [4, 4, 4]
            assert r["dims_after"][LAYER] == [4, 2, 4], r["dims_after"]  # shapes shrank on every rank
            assert {k: v for k, v in r["dims_after"].items() if k != LAYER} == \
                   {k: v for k, v in r["dims_before"].items() if k != LAYER}
            # the loss is continuous: slicing dead ranks does not change the function
            torch.testing.assert_close(r["after"][0], r["before"][0], rtol=1e-5, atol=1e-6)
            assert r["step_after"] == r["step_before"] == 2
            for name, m in r["moments_before"].items():  # Adam moments carried over
                new = r["moments_after"][name]
                if name.endswith(f"{LAYER}.core"):  # the flat cores, split at their shapes before and after
                    assert r["shapes_after"][BOND][-1] == 2 and r["shapes_after"][BOND + 1][0] == 2
                    for key in ("exp_avg", "exp_avg_sq"):
                        old = split_flat(m[key], r["shapes_before"])
                        for k, got in enumerate(split_flat(new[key], r["shapes_after"])):
                            want = old[k][..., 2:] if k == BOND else old[k][2:] if k == BOND + 1 else old[k]
                            torch.testing.assert_close(got, want, rtol=0, atol=0)
                elif name.endswith(f"{LAYER}.gate"):  # bonds [4, 4, 4] end to end; bond 1 keeps its last two
                    torch.testing.assert_close(new["exp_avg"], m["exp_avg"][[0, 1, 2, 3, 6, 7, 8, 9, 10, 11]])
                else:
                    torch.testing.assert_close(new["exp_avg"], m["exp_avg"], rtol=0, atol=0)
            assert torch.isfinite(torch.tensor(r["next"]))
        assert results[0][stage]["next"] == results[1][stage]["next"]
    # ZeRO-3 holds partitions: local shapes are empty while ds_shape carries the pruned sizes
    assert results[0][3]["local_shapes"][f"{LAYER}.gate"] == (0,)


def _poison(module, rank: int, armed: dict) -> None:
    """Rank 0's loss becomes NaN while ``armed["on"]``: only the all-reduce tells rank 1. With
    ``armed["from"] = k`` only the k-th and later forwards since arming are poisoned (a later micro-batch).
    With ``armed["add"]`` the NaN is added: the loss is NaN, its gradients stay finite."""
    def hook(_mod, _args, out):
        if armed["on"]:
            armed["calls"] = armed.get("calls", 0) + 1
            if rank == 0 and armed["calls"] > armed.get("from", 0):
                out["loss"] = out["loss"] + float("nan") if armed.get("add") else out["loss"] * float("nan")
        return out
    module.register_forward_hook(hook)


def _bf16_check_cases(rank: int, world_size: int, outdir: str) -> dict:
    """bf16 with and without ``deepspeed.bf16_overflow_check``: a NaN loss in the 2nd micro-batch, and
    NaN gradients under finite losses."""
    from comera_dist.engine.faults import NonFiniteInjector
    from comera_dist.engine.prune import optimizer_step_count
    from comera_dist.engine.session import TrainSession

    out: dict = {}
    cfg = tiny_config(f"{outdir}/nocheck-loss", zero_stage=1, accumulation=2, precision="bf16",
                      bf16_overflow_check=False)
    s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
    armed = {"on": False, "from": 1}
    _poison(s.module, rank, armed)
    s.train_step([batch(1, rank, m) for m in range(2)])
    before, steps_before = full_params(s), optimizer_step_count(s.engine)
    armed["on"] = True
    skipped = s.train_step([batch(2, rank, m) for m in range(2)])
    armed["on"] = False
    out["nocheck-loss"] = {"skipped": skipped.skipped_nonfinite, "calls": armed["calls"],
                           "unchanged": all(torch.equal(v, before[n]) for n, v in full_params(s).items()),
                           "ds_skipped": s.engine.skipped_steps,
                           "steps": (steps_before, optimizer_step_count(s.engine)),
                           "check": s.engine.optimizer.check_grad_overflow}
    s.close()
    for stage, precision, check in ((1, "bf16", True), (1, "bf16", False), (3, "bf16", False), (1, "fp32", False)):
        cfg = tiny_config(f"{outdir}/grads{stage}{precision}{check}", zero_stage=stage, precision=precision,
                          bf16_overflow_check=check)
        s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
        # the trainer's own fault hook: rank 0's gradients NaN at step 2, its loss finite
        faults = NonFiniteInjector(rank, {"COMERA_FAULT_NONFINITE_STEPS": "2", "COMERA_FAULT_RANKS": "0",
                                          "COMERA_FAULT_NONFINITE_KIND": "grad"})
        faults.attach(s.module)
        s.train_step([batch(1, rank)])
        before, controller_before = full_params(s), s.controller.state_dict()
        faults.arm(2)
        try:
            o = s.train_step([batch(2, rank)])
            case = {"skipped": o.skipped_nonfinite, "total": s.nonfinite_total, "ds_skipped": s.engine.skipped_steps,
                    "unchanged": all(torch.equal(v, before[n]) for n, v in full_params(s).items())
                    and s.controller.state_dict() == controller_before}
        except RuntimeError as e:
            case = {"error": str(e)}
        out[f"grads{stage}-{precision}-{'check' if check else 'nocheck'}"] = case
        s.close()
    return out


def _features(rank: int, world_size: int, outdir: str) -> dict:
    from comera_dist.engine.prune import optimizer_step_count
    from comera_dist.engine.session import TrainSession

    out: dict = {}
    for stage, accum in ((0, 1), (2, 2)):
        cfg = tiny_config(f"{outdir}/nan{stage}", zero_stage=stage, accumulation=accum)
        s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
        armed = {"on": False}
        _poison(s.module, rank, armed)
        s.train_step([batch(1, rank, m) for m in range(accum)])
        before, steps_before = full_params(s), optimizer_step_count(s.engine)
        controller_before = s.controller.state_dict()
        armed["on"] = True
        skipped = s.train_step([batch(2, rank, m) for m in range(accum)])
        armed["on"] = False
        unchanged = all(torch.equal(v, before[n]) for n, v in full_params(s).items())
        steps_after_skip = optimizer_step_count(s.engine)
        controller_after_skip = s.controller.state_dict()
        good = s.train_step([batch(3, rank, m) for m in range(accum)])
        out[f"nan{stage}"] = {"skipped": skipped, "unchanged": unchanged, "good": good,
                              "controller": (controller_before, controller_after_skip),
                              "counts": (steps_before, steps_after_skip, optimizer_step_count(s.engine)),
                              "total": s.nonfinite_total}
        s.close()
    # Only the second micro-batch is NaN: the first is already back-propagated into ZeRO's buffers when
    # the all-reduce reports it, so the session poisons the rest and DeepSpeed skips the step.
    # "late1-add": the NaN added (finite gradients): only the session's poisoning of the objective makes them NaN.
    for key, stage, precision in (("late1", 1, "fp32"), ("late2", 2, "bf16"), ("late3", 3, "bf16"),
                                  ("late1-add", 1, "fp32")):
        cfg = tiny_config(f"{outdir}/{key}", zero_stage=stage, accumulation=2, precision=precision,
                          scheduler={"kind": "warmup_decay", "warmup_steps": 3})
        s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
        armed = {"on": False, "from": 1, "add": key.endswith("-add")}
        _poison(s.module, rank, armed)
        s.train_step([batch(1, rank, m) for m in range(2)])
        before, steps_before = full_params(s), optimizer_step_count(s.engine)
        lrs_before = [g["lr"] for g in s.engine.optimizer.param_groups]
        controller_before = s.controller.state_dict()
        armed["on"] = True
        skipped = s.train_step([batch(2, rank, m) for m in range(2)])
        armed["on"] = False
        out[key] = {
            "skipped": skipped.skipped_nonfinite, "calls": armed["calls"],
            "controller": (controller_before, s.controller.state_dict()),
            "unchanged": all(torch.equal(v, before[n]) for n, v in full_params(s).items()),
            "lrs": (lrs_before, [g["lr"] for g in s.engine.optimizer.param_groups]),
            "ds_skipped": s.engine.skipped_steps, "steps": (steps_before, optimizer_step_count(s.engine)),
            "good": s.train_step([batch(3, rank, m) for m in range(2)]), "total": s.nonfinite_total,
            "after_good": optimizer_step_count(s.engine)}
        s.close()
    cfg = tiny_config(f"{outdir}/bf16", zero_stage=2, precision="bf16", steps=6, prune_every=4,
                      scheduler={"kind": "warmup_decay", "warmup_steps": 3})
    s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
    kill_two_ranks(s, LAYER, BOND)
    steps = [s.train_step([batch(k, rank)]) for k in range(1, 5)]
    master_before = full_params(s)
    lrs_before = [g["lr"] for g in s.engine.optimizer.param_groups]
    pruned = s.maybe_prune(4)  # bf16 rebuild: the fp32 master must survive, not the rounded bf16 copy
    master_after = full_params(s)
    out["bf16"] = {"losses": [o.task_loss for o in steps],
                   "group_lrs": {g["name"]: g["lr"] for g in s.engine.optimizer.param_groups},
                   "lrs": [o.lr for o in steps], "pruned": pruned, "dims": s.bond_dims()[LAYER],
                   "lrs_rebuild": (lrs_before, [g["lr"] for g in s.engine.optimizer.param_groups]),
                   "master_kept": all(torch.equal(master_after[n], master_before[n])
                                      for n in master_after if LAYER not in n),
                   "next": s.train_step([batch(5, rank)]).task_loss,
                   "dtype": str(next(s.module.parameters()).dtype)}
    s.close()
    return out



def test_contiguous_gradients_off_trains_the_same(short_runs):
    """``deepspeed.contiguous_gradients=false`` (fewer per-tensor ops) at ZeRO 1 and 2 on 2 ranks: DeepSpeed
    runs without the contiguous buffer, and the losses and weights are those of the default."""
    for rank in (0, 1):
        got = short_runs[rank]["contiguous"]
        for stage in (1, 2):
            on, off = got[(stage, True)], got[(stage, False)]
            assert (on["told"], on["engine"], off["told"], off["engine"]) == (True, True, False, False), stage
            assert_same_training(off, on, stage)
    assert short_runs[0]["contiguous"][(2, False)]["losses"] == short_runs[1]["contiguous"][(2, False)]["losses"]


def test_bf16_overflow_check_can_be_turned_off(short_runs):
    """``deepspeed.bf16_overflow_check=false`` at ZeRO 1: DeepSpeed's per-gradient check is off; a NaN loss is
    still skipped (by the probe, before any backward); NaN gradients under finite losses stop the run with
    the cause. With the check on, DeepSpeed skips that step and the session counts it; ZeRO-3 skips it
    either way."""
    for rank in (0, 1):
        r = short_runs[rank]["bf16-check"]
        case = r["nocheck-loss"]
        assert case["check"] is False  # the generated config really turned DeepSpeed's check off
        assert case["skipped"] and case["unchanged"] and case["steps"] == (1, 1)
        assert case["calls"] == 2 and case["ds_skipped"] == 0  # the probe's two forwards skipped it, not DeepSpeed
        # skipped by DeepSpeed and counted by the session: bf16 with the check, ZeRO-3 bf16 whatever the flag
        # says, fp32 (the flag is bf16's only); unchanged: the weights and the rank controller
        for key in ("grads1-bf16-check", "grads3-bf16-nocheck", "grads1-fp32-nocheck"):
            got = r[key]
            assert (got.get("skipped"), got.get("total"), got.get("ds_skipped"), got.get("unchanged")) == \
                (True, 1, 1, True), (key, got)
        off = r["grads1-bf16-nocheck"]
        assert "deepspeed.bf16_overflow_check=false" in off.get("error", ""), off


def test_nonfinite_skip_schedule_bf16(short_runs):
    """A NaN loss on one rank skips the step on both (ZeRO 0; ZeRO 2 with accumulation; ZeRO 1, 2 and 3
    with the NaN in a later micro-batch, skipped by DeepSpeed's overflow check); LR warmup per role;
    bf16 at ZeRO 2."""
    results = short_runs
    for rank in (0, 1):
        r = results[rank]
        for key in ("nan0", "nan2"):
            case = r[key]
            assert case["skipped"].skipped_nonfinite and case["unchanged"], key  # both ranks skip, no update
            assert case["total"] == 1 and not case["good"].skipped_nonfinite
            assert math.isfinite(case["good"].task_loss)
            before, after_skip, after_good = case["counts"]
            assert before == after_skip == 1 and after_good == 2  # the optimizer never ran on the NaN step
            assert case["controller"][1] == case["controller"][0], key  # nor did the rank controller move
        for key in ("late1", "late2", "late3", "late1-add"):  # ZeRO 1 fp32, ZeRO 2 and 3 bf16; NaN in the 2nd micro-batch
            case = r[key]
            assert case["skipped"] and case["calls"] == 2, key  # one forward per micro-batch: no probe
            assert case["ds_skipped"] == 1, key  # DeepSpeed's own overflow skip did it
            assert case["unchanged"] and case["lrs"][0] == case["lrs"][1], key  # weights and LR untouched
            assert case["steps"] == (1, 1) and case["after_good"] == 2, key  # the moments too
            # and the controller: the first micro-batch's advance (to step 2) is undone with the skip
            assert case["controller"][0]["step"] == 1 and case["controller"][1] == case["controller"][0], key
            assert case["total"] == 1 and not case["good"].skipped_nonfinite and math.isfinite(case["good"].task_loss)
        bf16 = r["bf16"]
        assert bf16["dtype"] == "torch.bfloat16" and all(math.isfinite(v) for v in bf16["losses"])
        # linear warmup over 3 steps (DeepSpeed counts from 0), each role at its own peak lr
        assert bf16["lrs"][0] < bf16["lrs"][1] < bf16["lrs"][2]
        assert bf16["group_lrs"]["gates"] / bf16["group_lrs"]["cores"] == 5.0
        assert bf16["pruned"] and bf16["dims"] == [4, 2, 4] and bf16["master_kept"]
        assert bf16["lrs_rebuild"][0] == bf16["lrs_rebuild"][1]  # the schedule continues across the rebuild
        assert math.isfinite(bf16["next"])
    assert results[0]["bf16"]["losses"] == results[1]["bf16"]["losses"]


STEPS, SAVE_AT = 4, 2


def _resume_session(outdir: str, stage: int):
    """The resume runs: dropout on and the late stage from step 2, so the checkpoint at step 2 holds a
    late-stage controller and an RNG stream that the next steps' dropout masks depend on."""
    return _session(outdir, stage, late_stage_step=SAVE_AT, dropout=0.1)


def _train(s, rank: int, steps: range) -> list[tuple]:
    """(task loss, objective, lambda, stage, skipped) per step. Step 1 is NaN on rank 0 (both ranks skip
    it and count it); two ranks are killed after it and pruned away at step 2."""
    armed = {"on": False}
    if steps.start == 1:
        _poison(s.module, rank, armed)  # the module is replaced by the step-2 prune, hook and all
    rows = []
    for step in steps:
        armed["on"] = step == 1
        o = s.train_step([batch(step, rank)])
        rows.append((o.task_loss, o.loss, o.lam, o.stage, o.skipped_nonfinite))
        if step == 1:
            kill_two_ranks(s, LAYER, BOND)
        s.maybe_prune(step)
    return rows


def _rng_digest() -> dict[str, str]:
    """This process's torch, python and numpy RNG positions, one digest each (read, not drawn from)."""
    import hashlib
    import random

    import numpy as np

    np_state = np.random.get_state()
    raw = {"torch": torch.get_rng_state().numpy().tobytes(), "python": repr(random.getstate()).encode(),
           "numpy": np_state[1].tobytes() + repr(np_state[2:]).encode()}
    return {k: hashlib.sha256(v).hexdigest()[:16] for k, v in raw.items()}


def _state(s) -> dict:
    """What a resume must bring back besides the weights: controller, counters, RNG streams."""
    return {"controller": s.controller.state_dict(), "nonfinite_total": s.nonfinite_total,
            "steps_done": s.steps_done, "rng": _rng_digest()}


def _straight_then_killed(rank: int, world_size: int, outdir: str) -> None:
    from comera_dist.engine.distributed import init_distributed

    init_distributed(60)
    for stage in (1, 3):
        s = _resume_session(f"{outdir}/straight{stage}", stage)
        rows = _train(s, rank, range(1, SAVE_AT + 1))
        at_save = _state(s)
        rows += _train(s, rank, range(SAVE_AT + 1, STEPS + 1))
        torch.save({"rows": rows, "at_save": at_save, "final": _state(s)}, Path(outdir) / f"straight{stage}-{rank}.pt")
        s.close()
    for stage in (1, 3):
        s = _resume_session(f"{outdir}/killed{stage}", stage)
        _train(s, rank, range(1, SAVE_AT + 1))
        s.save(SAVE_AT, {"data_position": SAVE_AT * 10 + rank})
        _train(s, rank, range(SAVE_AT + 1, SAVE_AT + 2))  # progress after the save is lost by the kill
        if stage == 3:
            # Every rank writes its shards of the next checkpoint, then rank 0 dies before publishing
            # it (rank 1 fails in the next collective): `latest` must stay on the step-2 checkpoint.
            s.save(SAVE_AT + 1, before_publish=lambda tmp_dir: os.kill(os.getpid(), signal.SIGKILL))
        s.close()


def _resumed(rank: int, world_size: int, outdir: str) -> dict:
    from comera_dist.engine.distributed import init_distributed

    init_distributed(60)
    out = {}
    for stage in (1, 3):
        s = _resume_session(f"{outdir}/killed{stage}", stage)
        client = s.resume("auto")
        at_resume = _state(s)
        out[stage] = {"client": client, "dims": s.bond_dims(), "at_resume": at_resume,
                      "rows": _train(s, rank, range(client["step"] + 1, STEPS + 1)), "final": _state(s)}
        s.close()
    return out


def test_kill_and_resume_is_bitwise_identical(tmp_path):
    """2N straight == N, kill, resume auto, N more (bitwise, ZeRO 1 and 3, pruned model, dropout on, a
    late-stage controller, a counted non-finite step); a save killed before publication never moves
    ``latest`` and ``resume auto`` takes the last complete one."""
    runs = tmp_path / "runs"
    runs.mkdir()
    run_ranks(_straight_then_killed, tmp_path / "work1", str(runs), expect_exit={0: -signal.SIGKILL, 1: None})
    root = runs / "killed3" / "checkpoints"
    assert (root / "latest").read_text() == "step00000002"
    partial = root / ".tmp-step00000003"  # shards written, never published
    assert any(partial.iterdir()) and not (partial / "COMPLETE").exists()
    assert not (root / "step00000003").exists()
    resumed = run_ranks(_resumed, tmp_path / "work2", str(runs))
    differ = []
    for stage in (1, 3):
        ckpt = runs / f"killed{stage}" / "checkpoints" / "step00000002"
        assert (ckpt / "COMPLETE").is_file() and (ckpt / "config.yaml").is_file()
        for rank in (0, 1):
            r = resumed[rank][stage]
            straight = torch.load(runs / f"straight{stage}-{rank}.pt")
            # The case exercises what a resume restores: the save is in the late stage with lambda decided,
            # after one skipped step; a fresh session would differ in each of these.
            saved = straight["at_save"]
            assert saved["controller"]["stage"] == "late" and saved["controller"]["lam"] in (0, 1)
            assert saved["controller"]["switch_step"] == SAVE_AT and saved["nonfinite_total"] == 1
            assert straight["rows"][0][4] and not any(row[4] for row in straight["rows"][1:])
            assert r["client"] == {"data_position": SAVE_AT * 10 + rank, "step": SAVE_AT, "checkpoint_dir": ckpt}
            assert r["dims"][LAYER] == [4, 2, 4]  # rebuilt at the pruned shapes before loading
            # Restored as saved, then the same dropout masks, objectives, lambdas and stages (bitwise).
            # Every difference is listed, not only the first: a lost RNG restore shows in the rows too.
            differ += [f"z{stage} rank {rank} at resume: {key} {r['at_resume'][key]} != {saved[key]}"
                       for key in saved if r["at_resume"][key] != saved[key]]
            if r["rows"] != straight["rows"][SAVE_AT:]:
                differ.append(f"z{stage} rank {rank} steps {SAVE_AT + 1}-{STEPS}: {r['rows']} != "
                              f"{straight['rows'][SAVE_AT:]}")
            differ += [f"z{stage} rank {rank} at the end: {key}" for key in saved
                       if r["final"][key] != straight["final"][key]]
    assert not differ, "\n".join(differ)
