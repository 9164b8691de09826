"""The numbers a session reports, against an independent computation, on 2 real ranks.

``train_step``'s ``StepOutput`` is recomputed in plain PyTorch in the test process from the weights
and the controller state the session held before the step: the task loss from the model on both
ranks' micro-batches, R from ``compression.penalty.rank_penalty``, lambda and the stage from a
``RankController`` at the saved state, the objective it builds, and the norm of that objective's
gradient (DeepSpeed's norm is taken before clipping). ``evaluate``'s loss and accuracy are
recomputed from logits by hand (cross-entropy, arg-max) for the MLM and for the GPT, whose label of
position t is the token at t + 1. ZeRO 1 puts R in the loss, ZeRO 3 goes through the penalty hook's
proxy: both are checked. (ZeRO 0 in fp32 reports no gradient norm: DeepSpeed's plain optimizer
path records none, and the session says nan.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from dist_helpers import run_ranks
from engine_cases import batch, factory, full_params, micro_batches, model_with, tiny_config

STEPS, ACCUM, STAGES = 2, 2, (1, 3)
FIELDS = ("loss", "task_loss", "penalty", "lam", "stage", "grad_norm", "skipped_nonfinite")


def _config(outdir: str, stage: int, arch: str = "bert_mlm"):
    # late stage at step 2: step 1 reports the early objective, step 2 the late one with lambda decided
    return tiny_config(f"{outdir}/{arch}{stage}", zero_stage=stage, steps=STEPS, accumulation=ACCUM,
                       late_stage_step=2, gamma=0.5, arch=arch)


def _probe(rank: int) -> list[dict[str, torch.Tensor]]:
    """Evaluation batches of ``rank``: the label of a kept position is its own input token, which a
    freshly initialised tied head tends to predict, so an unshifted causal score stands out."""
    return [batch(90 + i, rank) for i in range(2)]


def _session_values(rank: int, world_size: int, outdir: str) -> dict:
    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.session import TrainSession

    init_distributed(60)
    out: dict = {}
    for stage in STAGES:
        cfg = _config(outdir, stage)
        s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
        steps = []
        for step in range(1, STEPS + 1):
            before = {"params": full_params(s), "controller": s.controller.state_dict()}
            o = s.train_step(micro_batches(step, rank, ACCUM))
            steps.append({"before": before, "out": {k: getattr(o, k) for k in FIELDS}})
        out[stage] = {"steps": steps, "params": full_params(s), "eval": s.evaluate(_probe(rank))}
        s.close()
    cfg = _config(outdir, 0, arch="gpt")
    s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
    out["gpt"] = {"params": full_params(s), "eval": s.evaluate(_probe(rank))}
    s.close()
    return out


def _reference_step(cfg, before: dict, step: int) -> dict:
    """What step ``step`` must report, from the weights and controller state before it."""
    from comera_dist.compression.accounting import model_size
    from comera_dist.compression.controller import RankController
    from comera_dist.compression.penalty import rank_penalty

    model = model_with(cfg, before["params"])
    # the global task loss: the mean over both ranks' micro-batches
    task = torch.stack([model(**mb)["loss"] for r in range(2) for mb in micro_batches(step, r, ACCUM)]).mean()
    penalty, size = rank_penalty(model), model_size(model)
    controller = RankController(cfg.comera.controller)
    controller.load_state_dict(before["controller"])
    global_loss = float(task.detach())
    controller.advance(step, global_loss, size)
    objective = controller.objective(task, penalty, global_loss=global_loss, global_size=size)
    objective.backward()
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))
    late = controller.stage == "late"
    return {"loss": float(objective.detach()), "task_loss": global_loss, "penalty": float(penalty.detach()),
            "lam": float(controller.lam) if late else 0.0, "stage": controller.stage, "grad_norm": norm,
            "skipped_nonfinite": False}


@torch.no_grad()
def _reference_eval(cfg, params: dict[str, torch.Tensor], *, shift: bool) -> tuple[float, float]:
    """Token-weighted (loss, accuracy) over both ranks' probe batches, from logits by hand."""
    model = model_with(cfg, params).eval()
    loss_sum, correct, count = 0.0, 0, 0
    for b in _probe(0) + _probe(1):
        logits, labels = model(input_ids=b["input_ids"])["logits"], b["labels"]  # (B, T, V), (B, T)
        if shift:  # position t predicts the token at t + 1
            logits, labels = logits[:, :-1], labels[:, 1:]
        keep = labels != -100  # (B, T)
        picked, target = logits[keep].double(), labels[keep]  # (N, V), (N,)
        loss_sum += float(F.cross_entropy(picked, target, reduction="sum"))
        correct += int((picked.argmax(-1) == target).sum())
        count += int(keep.sum())
    return loss_sum / count, correct / count


def test_step_output_and_evaluate_match_independent_computation(tmp_path):
    results = run_ranks(_session_values, tmp_path / "work", str(tmp_path / "runs"))
    for stage in STAGES:
        cfg = _config(str(tmp_path / "ref"), stage)
        steps = results[0][stage]["steps"]
        for step, got in enumerate(steps, start=1):
            want = _reference_step(cfg, got["before"], step)
            out = got["out"]
            where = f"z{stage} step {step}: {out} != {want}"
            assert (out["stage"], out["lam"], out["skipped_nonfinite"]) == \
                   (want["stage"], want["lam"], want["skipped_nonfinite"]), where
            for key in ("loss", "task_loss", "penalty"):
                assert math.isclose(out[key], want[key], rel_tol=1e-5), f"{key}, {where}"
            assert math.isclose(out["grad_norm"], want["grad_norm"], rel_tol=1e-4), f"grad_norm, {where}"
        assert [s["out"] for s in steps] == [s["out"] for s in results[1][stage]["steps"]]  # global values
        # the case reaches what it means to check: both stages, and lambda 1 in the late one
        assert [s["out"]["stage"] for s in steps] == ["early", "late"] and steps[1]["out"]["lam"] == 1.0
        assert results[0][stage]["eval"] == results[1][stage]["eval"]
        loss, accuracy = _reference_eval(cfg, results[0][stage]["params"], shift=False)
        got_loss, got_accuracy = results[0][stage]["eval"]
        assert 0.0 < accuracy < 1.0 and got_accuracy == accuracy, (stage, got_accuracy, accuracy)
        assert math.isclose(got_loss, loss, rel_tol=1e-6), (stage, got_loss, loss)
    gpt_cfg = _config(str(tmp_path / "ref"), 0, arch="gpt")
    gpt = results[0]["gpt"]
    loss, accuracy = _reference_eval(gpt_cfg, gpt["params"], shift=True)
    _, unshifted = _reference_eval(gpt_cfg, gpt["params"], shift=False)
    assert unshifted != accuracy  # the case can tell a lost shift
    assert results[1]["gpt"]["eval"] == gpt["eval"]
    assert gpt["eval"][1] == accuracy, (gpt["eval"], accuracy, unshifted)
    assert math.isclose(gpt["eval"][0], loss, rel_tol=1e-6), (gpt["eval"], loss)
