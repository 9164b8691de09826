"""The validation loss of a run does not depend on its world size: the same weights evaluated on 1, 2 and 3 real
gloo ranks (``build_run_data``'s validation pass, ``TrainSession.evaluate``) give the same loss and accuracy.

So a run resumed elastically on another number of ranks continues the same validation curve. At micro-batch 1 the
ranks' shards differ by one block and the shorter one ends with a filler forward: under ZeRO 3, whose forwards
are collective, a rank left without it would hang the others."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from dist_helpers import run_ranks

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.distributed


def _validate(rank: int, world_size: int, out: str, cache: str, *overrides: str) -> dict:
    from comera_dist.config import load_run_config
    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.run_data import build_run_data
    from comera_dist.engine.session import TrainSession
    from comera_dist.models import build_model

    cfg = load_run_config(REPO / "configs/tiny-cpu.yaml", [f"train.output_dir={out}", f"data.cache_dir={cache}",
                                                           "data.max_files=12", *overrides])
    info = init_distributed(cfg.train.process_group_timeout_s)
    data = build_run_data(cfg, info)
    data.train.close()
    session = TrainSession.create(cfg, lambda: build_model(cfg.model, cfg.comera.tensorize), world_size=world_size)
    batches = list(data.validation_batches())
    loss, accuracy = session.evaluate(batches)
    session.close()
    return {"loss": loss, "accuracy": accuracy, "batches": len(batches),
            "blocks": sum(len(b["input_ids"]) for b in batches)}


@pytest.mark.parametrize(("zero", "micro", "eval_batches"), [(1, 4, 3), (3, 1, 5)])
def test_the_same_weights_give_the_same_validation_loss_on_1_2_and_3_ranks(tmp_path, zero, micro, eval_batches):
    knobs = (f"deepspeed.zero_stage={zero}", f"deepspeed.micro_batch_size_per_gpu={micro}",
             f"train.eval_batches={eval_batches}")
    cache = str(tmp_path / "cache")  # one tokenizer and one set of blocks for all three
    by_world = {w: run_ranks(_validate, tmp_path / f"w{w}", str(tmp_path / f"run{w}"), cache, *knobs, world_size=w)
                for w in (1, 2, 3)}
    blocks = micro * eval_batches
    for w, results in by_world.items():
        assert sum(r["blocks"] for r in results) >= blocks, (w, results)  # fillers come on top
        assert len({r["batches"] for r in results}) == 1, (w, results)  # the ranks stay in step
        assert len({(r["loss"], r["accuracy"]) for r in results}) == 1, (w, results)  # a global value
    one = by_world[1][0]
    assert one["blocks"] == blocks and math.isfinite(one["loss"])
    for w in (2, 3):
        got = by_world[w][0]
        assert math.isclose(got["loss"], one["loss"], rel_tol=1e-5), (w, got, one)
        assert got["accuracy"] == one["accuracy"], (w, got, one)
