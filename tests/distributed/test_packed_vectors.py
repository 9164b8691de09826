"""``deepspeed.pack_vectors`` on 2 real ranks: the packed engine trains like the plain one, and checkpoints
cross between packed and plain engines (ZeRO 1 <-> 3, and the flag flipped at one stage)."""

from __future__ import annotations

import logging

import pytest
import torch
from dist_helpers import run_ranks
from engine_cases import batch, factory, full_params, tiny_config

from comera_dist.engine.packing import NAME


def _cases(rank: int, world_size: int, outdir: str) -> dict:
    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.session import TrainSession

    init_distributed(60)
    out: dict = {"train": {}, "resume": {}, "routes": {}}
    for stage, precision, accum in ((1, "bf16", 1), (2, "fp32", 2)):
        for pack in (True, False):
            cfg = tiny_config(f"{outdir}/train{stage}{pack}", zero_stage=stage, precision=precision,
                              accumulation=accum, pack_vectors=pack)
            s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
            losses = [s.train_step([batch(step, rank, m) for m in range(accum)]).task_loss for step in (1, 2, 3)]
            out["train"][(stage, pack)] = {"losses": losses, "params": full_params(s),
                                           "names": [n for n, _ in s.module.named_parameters()]}
            s.engine.destroy()
    # Save after 2 steps, then step 3 three ways: straight on, and resumed by an engine of the other packing
    # (at the same stage: DeepSpeed's shards cannot load, the consolidated state must) and at ZeRO 3.
    writer = tiny_config(f"{outdir}/writer", zero_stage=1, steps=3)
    s = TrainSession.create(writer, factory(writer), world_size=world_size)
    for step in (1, 2):
        s.train_step([batch(step, rank)])
    path = s.save(2)
    out["resume"]["straight"] = s.train_step([batch(3, rank)]).task_loss
    s.engine.destroy()
    for label, stage, pack in (("unpacked", 1, False), ("zero3", 3, True), ("packed", 1, True)):
        cfg = tiny_config(f"{outdir}/writer", zero_stage=stage, steps=3, pack_vectors=pack)
        s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
        seen: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record, seen=seen: seen.append(record.getMessage())
        logger = logging.getLogger("comera_dist.engine.resume")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            s.resume(str(path))
        finally:
            logger.removeHandler(handler)
        out["routes"][label] = " ".join(m for m in seen if "elastic resume" in m)
        out["resume"][label] = s.train_step([batch(3, rank)]).task_loss
        s.engine.destroy()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packed")
    return run_ranks(_cases, tmp / "work", str(tmp / "runs"))


def test_packed_engine_trains_like_the_plain_one(runs):
    for rank in (0, 1):
        for stage in (1, 2):
            packed, plain = runs[rank]["train"][(stage, True)], runs[rank]["train"][(stage, False)]
            assert NAME in packed["names"] and NAME not in plain["names"]
            # every bias and LayerNorm vector went into the one parameter
            assert len(plain["names"]) - len(packed["names"]) >= 5, (plain["names"], packed["names"])
            torch.testing.assert_close(torch.tensor(packed["losses"]), torch.tensor(plain["losses"]),
                                       rtol=1e-5, atol=1e-6)
            assert plain["losses"][2] != plain["losses"][0]  # it trained
            assert packed["params"].keys() == plain["params"].keys()
            for name, value in plain["params"].items():
                torch.testing.assert_close(packed["params"][name], value, rtol=1e-5, atol=1e-6, msg=f"z{stage} {name}")


def test_checkpoints_cross_between_packed_and_plain_engines(runs):
    for rank in (0, 1):
        got = runs[rank]["resume"]
        for label in ("unpacked", "zero3", "packed"):
            assert got[label] == pytest.approx(got["straight"], rel=1e-5), (rank, label, got)
    routes = runs[0]["routes"]  # rank 0 logs the consolidated route and why it was taken
    assert "dense vectors packed -> unpacked" in routes["unpacked"], routes
    assert "-> 2 rank(s) at ZeRO 3" in routes["zero3"], routes
    assert routes["packed"] == "", routes  # same packing and stage: DeepSpeed's own shards
