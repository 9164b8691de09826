"""Elastic resume on real ranks, without a manual step: 2 ranks -> 1, 1 -> 2, ZeRO 1 -> 3, 1 -> 0 and 0 -> 1.

Every run trains the same pruned, late-stage, warmup-cosine CoMERA model on one global batch of
4 blocks per step (2 ranks x 2, or 1 rank x 2 micro-batches x 2), reading a synthetic dataset
through the real ``PackedLoader`` whose position travels in the checkpoint. The block ids of each
step are recovered from the tokens (causal collator: inputs unchanged), so the test sees exactly
which samples every step consumed. A resumed run must consume the straight run's ids, step for
step (none repeated, none skipped), keep the pruned shapes, the controller's stage and lambda
and the LR schedule, and continue the loss curve within float noise.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_testlib import revouch
from dist_helpers import run_ranks
from engine_cases import MICRO, SEQ, factory, kill_two_ranks, tiny_config

STEPS, SAVE_AT, BLOCKS, GLOBAL = 6, 3, 60, 4
LAYER, BOND = "blocks.0.attn.query", 1


def _dataset():
    import datasets

    rows = [[5 + i % 50, 5 + i // 50] + [5 + (7 * i + 13 * j) % 59 for j in range(SEQ - 2)] for i in range(BLOCKS)]
    return datasets.Dataset.from_dict({"input_ids": rows})


def _block_ids(mb: dict) -> list[int]:
    ids = mb["input_ids"]  # (B, T)
    return [int(a - 5) + 50 * int(b - 5) for a, b in zip(ids[:, 0], ids[:, 1])]


def _run(rank: int, world_size: int, outdir: str, stage: int, resume: str | None) -> dict:
    """Train to STEPS (from ``resume``, a checkpoint path, if given); save at SAVE_AT in a fresh run."""
    import deepspeed.comm as dist

    from comera_dist.compression.walk import tensorized_modules
    from comera_dist.data.collators import causal_collator
    from comera_dist.data.loader import PackedLoader
    from comera_dist.engine.session import TrainSession

    cfg = tiny_config(outdir, zero_stage=stage, steps=STEPS, accumulation=GLOBAL // (MICRO * world_size),
                      prune_every=2, late_stage_step=2, scheduler={"kind": "warmup_cosine", "warmup_steps": 2})
    s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
    loader = PackedLoader(_dataset(), batch_size=MICRO, rank=rank, world_size=world_size, seed=0,
                          collator=causal_collator())
    start = 0
    if resume is not None:
        client = s.resume(resume)
        loader.load_state_dict(client["data_state"])
        start = client["step"]
    out = {"ids": {}, "loss": {}, "lr": {}, "stage": {}, "lam": {}}
    for step in range(start + 1, STEPS + 1):
        mbs = [next(loader) for _ in range(s.accumulation)]
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, [i for mb in mbs for i in _block_ids(mb)])
        out["ids"][step] = sorted(i for ids in everyone for i in ids)
        o = s.train_step(mbs)
        if step == 1:
            kill_two_ranks(s, LAYER, BOND)
        s.maybe_prune(step)
        out["loss"][step], out["lr"][step], out["stage"][step], out["lam"][step] = o.task_loss, o.lr, o.stage, o.lam
        if resume is None and step == SAVE_AT:
            s.save(step, {"data_state": loader.state_dict()})
            out["saved_shapes"] = {n: layer.core_shapes() for n, layer in tensorized_modules(s.module)}
    out["dims"] = s.bond_dims()
    out["plans"] = [p.to_json() for p in s.plans]
    out["controller"] = s.controller.state_dict()
    out["counters"] = (int(s.engine.global_steps), int(s.engine.global_samples))
    s.close()
    return out


def _jobs(rank: int, world_size: int, root: str, plan: list) -> dict:
    from comera_dist.engine.distributed import init_distributed

    init_distributed(60)
    return {name: _run(rank, world_size, f"{root}/{name}", stage, resume) for name, stage, resume in plan}


def _as_layout1_checkpoint(src: Path, dst: Path, shapes: dict[str, list[tuple[int, ...]]]) -> None:
    """``dst``: the checkpoint ``src`` as a version with one Parameter per core and per bond would
    have written it (``param_layout`` 1): consolidated state with ``<layer>.cores.<k>`` and
    ``<layer>.gates.<k>`` params and moments, no ``param_layout`` in the meta, and DeepSpeed shards
    that this version cannot load (garbage here: a resume that touched them would fail). ``shapes``:
    every layer's core shapes at the save. The manifest is rewritten to match."""
    from comera_dist.engine import checkpoint as ckpt

    shutil.copytree(src, dst)
    payload = torch.load(dst / ckpt.FULL_STATE, map_location="cpu", weights_only=True)
    assert sorted(shapes) == sorted(n[: -len(".core")] for n in payload["params"] if n.endswith(".core"))
    for prefix, cores in shapes.items():
        sizes = {"core": [math.prod(c) for c in cores], "gate": [c[-1] for c in cores[:-1]]}
        views = {"core": cores, "gate": [(c[-1],) for c in cores[:-1]]}
        for leaf, old in (("core", "cores"), ("gate", "gates")):
            flat, moments = payload["params"].pop(f"{prefix}.{leaf}"), payload["moments"].pop(f"{prefix}.{leaf}")
            for k, (piece, shape) in enumerate(zip(flat.split(sizes[leaf]), views[leaf])):
                payload["params"][f"{prefix}.{old}.{k}"] = piece.reshape(shape).clone()
                payload["moments"][f"{prefix}.{old}.{k}"] = {
                    m: v.split(sizes[leaf])[k].reshape(shape).clone() for m, v in moments.items()}
    torch.save(payload, dst / ckpt.FULL_STATE)
    meta = json.loads((dst / ckpt.META).read_text())
    del meta["param_layout"]
    (dst / ckpt.META).write_text(json.dumps(meta))
    for shard in dst.glob("*_states.pt"):
        shard.write_bytes(b"not a DeepSpeed shard of this layout")
    revouch(dst)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("elastic")
    root = str(tmp / "runs")
    ckpt = f"checkpoints/step{SAVE_AT:08d}"
    two = run_ranks(_jobs, tmp / "w1", root, [("straight2", 1, None), ("straight2_zero0", 0, None)])
    _as_layout1_checkpoint(Path(root) / "straight2" / ckpt, Path(root) / "layout1" / ckpt,
                           two[0]["straight2"]["saved_shapes"])
    one = run_ranks(_jobs, tmp / "w2", root, [("straight1", 1, None), ("from2", 1, f"{root}/straight2/{ckpt}")],
                    world_size=1)
    back = run_ranks(_jobs, tmp / "w3", root, [("from1", 1, f"{root}/straight1/{ckpt}"),
                                               ("zero3", 3, f"{root}/straight2/{ckpt}"),
                                               ("zero0", 0, f"{root}/straight2/{ckpt}"),
                                               ("from_zero0", 1, f"{root}/straight2_zero0/{ckpt}"),
                                               ("legacy", 1, f"{root}/layout1/{ckpt}")])
    return {**two[0], **one[0], **back[0], "ranks": (two, back)}  # every run by name, as rank 0 saw it


@pytest.mark.parametrize("case", ["from2", "from1", "zero3", "zero0", "from_zero0", "legacy"])
def test_elastic_resume_continues_the_straight_run(runs, case):
    """2 ranks -> 1 (``from2``), 1 -> 2 (``from1``), ZeRO 1 -> 3 (``zero3``), 1 -> 0 (``zero0``) and 0 -> 1
    (``from_zero0``, against the straight run at ZeRO 0 that saved it) at 2 ranks, and 2 ranks -> 2 from a
    checkpoint of the oldest layout, one parameter per core and per bond (``legacy``: converted,
    DeepSpeed's shards unused)."""
    ref, r = runs["straight2_zero0" if case == "from_zero0" else "straight2"], runs[case]
    resumed = list(range(SAVE_AT + 1, STEPS + 1))
    assert sorted(r["ids"]) == resumed
    for step in resumed:  # the same samples, step for step: none repeated, none skipped
        assert r["ids"][step] == ref["ids"][step], (case, step)
        assert r["lr"][step] == pytest.approx(ref["lr"][step], rel=1e-9)
        assert r["stage"][step] == ref["stage"][step] == "late"
        assert r["lam"][step] == ref["lam"][step]
    torch.testing.assert_close(torch.tensor([r["loss"][s] for s in resumed]),
                               torch.tensor([ref["loss"][s] for s in resumed]), rtol=1e-4, atol=1e-5)
    assert r["plans"] == ref["plans"] and len(r["plans"]) >= 1  # the pruning plan came along
    assert r["dims"] == ref["dims"] and r["dims"][LAYER] == [4, 2, 4]
    assert r["counters"] == ref["counters"]  # DeepSpeed's step and sample counters came along
    assert r["controller"].keys() == ref["controller"].keys()
    for key, value in ref["controller"].items():  # stage, switch step, lambda, S*, ...
        assert r["controller"][key] == (pytest.approx(value, rel=1e-5) if isinstance(value, float) else value), key


def test_straight_runs_agree_and_ranks_agree(runs):
    """The references: 1 and 2 ranks consume the same ids (one global batch); ranks agree on the loss."""
    one, two = runs["straight1"], runs["straight2"]
    assert one["ids"] == two["ids"]
    assert len({i for ids in two["ids"].values() for i in ids}) == STEPS * GLOBAL  # no id twice
    for job in runs["ranks"]:
        for name in job[0]:
            assert job[0][name]["loss"] == job[1][name]["loss"], name
