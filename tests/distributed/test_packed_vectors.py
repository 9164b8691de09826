"""``deepspeed.pack_vectors`` on 2 real ranks: the packed engine (cores, gates and dense vectors, one flat
parameter each) trains like the plain one, and checkpoints cross between packed and plain engines
(ZeRO 1 <-> 3, the flag flipped at one stage, and a checkpoint of the first packing, dense vectors only)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from checkpoint_testlib import revouch
from dist_helpers import run_ranks
from engine_cases import assert_same_training, batch, factory, full_params, knob_runs, tiny_config

from comera_dist.engine.packing import NAMES


def _cases(rank: int, world_size: int, outdir: str) -> dict:
    import torch.distributed as dist

    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.session import TrainSession

    init_distributed(60)
    out: dict = {"resume": {}, "routes": {}}
    out["train"] = knob_runs(outdir, rank, world_size, "pack_vectors",
                             lambda s: {"names": [n for n, _ in s.module.named_parameters()]})
    out["fallback"] = _without_forward_penalty(outdir, rank, world_size)
    # Save after 2 steps, then step 3 three ways: straight on, and resumed by an engine of the other packing
    # (at the same stage: DeepSpeed's shards cannot load, the consolidated state must) and at ZeRO 3.
    writer = tiny_config(f"{outdir}/writer", zero_stage=1, steps=3)
    s = TrainSession.create(writer, factory(writer), world_size=world_size)
    for step in (1, 2):
        s.train_step([batch(step, rank)])
    path = s.save(2)
    out["resume"]["straight"] = s.train_step([batch(3, rank)]).task_loss
    s.close()
    first = path.parent.parent / "first-packing" / path.name
    layout_1 = path.parent.parent / "layout-1" / path.name
    if rank == 0:
        _as_older_checkpoint(path, first, first_packing=True)
        _as_older_checkpoint(path, layout_1, first_packing=False)
    dist.barrier()
    for label, stage, pack, src in (("unpacked", 1, False, path), ("zero3", 3, True, path),
                                    ("packed", 1, True, path), ("first_packing", 1, True, first),
                                    ("layout_1", 1, True, layout_1)):
        cfg = tiny_config(f"{outdir}/writer", zero_stage=stage, steps=3, pack_vectors=pack)
        s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
        seen: list[str] = []
        handler = logging.Handler()
        handler.emit = lambda record, seen=seen: seen.append(record.getMessage())
        logger = logging.getLogger("comera_dist.engine.resume")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            s.resume(str(src))
        finally:
            logger.removeHandler(handler)
        out["routes"][label] = " ".join(m for m in seen if "elastic resume" in m)
        out["resume"][label] = s.train_step([batch(3, rank)]).task_loss
        s.close()
    return out


def _as_older_checkpoint(src: Path, dst: Path, *, first_packing: bool) -> None:
    """``dst``: the checkpoint ``src`` as an older packing would have written it, with DeepSpeed shards this
    version cannot load (garbage here: a resume that touched them would fail). ``first_packing`` (dense
    vectors only): ``packed_vectors: true`` in the meta instead of ``packing``; else the first packing
    layout (1-D parameters of every role, before 2-D ones were packed): no ``packing_layout``. The
    manifest is rewritten to match."""
    from comera_dist.engine import checkpoint as ckpt

    shutil.copytree(src, dst)
    meta = json.loads((dst / ckpt.META).read_text())
    del meta["packing_layout"]
    if first_packing:
        del meta["packing"]
        meta["packed_vectors"] = True
    (dst / ckpt.META).write_text(json.dumps(meta))
    for shard in dst.glob("*_states.pt"):
        shard.write_bytes(b"not a DeepSpeed shard of this packing")
    revouch(dst)


def _without_forward_penalty(outdir: str, rank: int, world_size: int) -> dict:
    """The packed ZeRO-1 bf16 knob run again with a model whose forward gives no R (as the HF models):
    the session computes ``rank_penalty`` itself, with the packed gates attached to autograd."""
    from comera_dist.engine.session import TrainSession
    from comera_dist.models import bert_mlm

    real = bert_mlm.shared_factors_and_penalty
    bert_mlm.shared_factors_and_penalty = lambda model, skip=(): (real(model, skip)[0], None)
    try:
        cfg = tiny_config(f"{outdir}/fallback", zero_stage=1, precision="bf16", pack_vectors=True)
        s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
        losses = [s.train_step([batch(step, rank, 0)]).task_loss for step in (1, 2, 3)]
        out = {"losses": losses, "params": full_params(s)}
        s.close()
    finally:
        bert_mlm.shared_factors_and_penalty = real
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packed")
    return run_ranks(_cases, tmp / "work", str(tmp / "runs"))


def test_packed_engine_trains_like_the_plain_one(runs):
    for rank in (0, 1):
        for stage in (1, 2):
            packed, plain = runs[rank]["train"][(stage, True)], runs[rank]["train"][(stage, False)]
            assert set(NAMES.values()) <= set(packed["names"]) and not set(NAMES.values()) & set(plain["names"])
            # every core, gate, bias and LayerNorm vector went into the three flat parameters
            assert not [n for n in packed["names"] if n.endswith((".core", ".gate", ".bias"))], packed["names"]
            assert len(plain["names"]) - len(packed["names"]) >= 10, (plain["names"], packed["names"])
            assert_same_training(packed, plain, stage)


def test_the_sessions_own_penalty_reaches_the_packed_gates(runs):
    """Without R from the forward the session's ``rank_penalty`` must still train the packed gates:
    the same weights as with the forward's R (the gates' penalty gradient is 1/#alive either way)."""
    for rank in (0, 1):
        assert_same_training(runs[rank]["fallback"], runs[rank]["train"][(1, True)], 1)


def test_checkpoints_cross_between_packed_and_plain_engines(runs):
    for rank in (0, 1):
        got = runs[rank]["resume"]
        for label in ("unpacked", "zero3", "packed", "first_packing", "layout_1"):
            assert got[label] == pytest.approx(got["straight"], rel=1e-5), (rank, label, got)
    routes = runs[0]["routes"]  # rank 0 logs the consolidated route and why it was taken
    assert "packed roles ['cores', 'dense', 'gates'] (layout 2) -> none (layout 0)" in routes["unpacked"], routes
    assert "-> 2 rank(s) at ZeRO 3" in routes["zero3"], routes
    assert routes["packed"] == "", routes  # same packing and stage: DeepSpeed's own shards
    # a checkpoint of the first packing (dense vectors only): its shards cannot load, the consolidated state does
    assert "packed roles ['dense'] (layout 1) -> ['cores', 'dense', 'gates'] (layout 2)" in routes["first_packing"], \
        routes
    # a checkpoint of the first layout (1-D parameters only): the same
    assert "packed roles ['cores', 'dense', 'gates'] (layout 1) -> ['cores', 'dense', 'gates'] (layout 2)" in \
        routes["layout_1"], routes
