"""``comera evaluate`` / ``comera export`` (``evaluate.load_run``) pass a checkpoint through the ``weights_only``
gate before anything unpickles it, as a resume does.

The manifest detects corruption, not tampering: a shard that carries a ``__reduce__`` payload beside a
re-rendered manifest verifies, so only the gate stands between it and ``torch.load(weights_only=False)``
(ours at ZeRO 0, DeepSpeed's ``zero_to_fp32`` at ZeRO 1). The checkpoints come from two spawned ranks, and at
ZeRO 1 the payload is in rank 1's optimizer shard (a gate that read rank 0's files only would let it through);
the loading happens here, outside any process group, as the CLI does it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoint_testlib import plant_payload
from dist_helpers import run_ranks
from engine_cases import batch, factory, tiny_config

SHARDS = {0: "mp_rank_00_model_states.pt", 1: "zero_pp_rank_1_mp_rank_00_optim_states.pt"}


def _write(rank: int, world_size: int, outdir: str) -> dict[int, str]:
    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.session import TrainSession

    init_distributed(60)
    paths = {}
    for stage in SHARDS:
        cfg = tiny_config(f"{outdir}/z{stage}", zero_stage=stage, steps=2)
        s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
        s.train_step([batch(1, rank)])
        paths[stage] = str(s.save(1))
        s.close()
    return paths


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evil_eval")
    return {stage: Path(p) for stage, p in run_ranks(_write, tmp / "w", str(tmp / "runs"), world_size=2)[0].items()}


@pytest.mark.parametrize("stage", sorted(SHARDS))
def test_load_run_refuses_a_shard_with_a_pickled_payload_before_unpickling_it(written, tmp_path, stage):
    from comera_dist.engine import checkpoint as ckpt
    from comera_dist.engine.errors import InputError
    from comera_dist.engine.evaluate import load_run

    path = written[stage]
    assert load_run(path).model is not None  # DeepSpeed's own shards pass the gate
    flag = tmp_path / "PWNED"
    plant_payload(path, SHARDS[stage], flag)
    assert ckpt.check(path) == []  # the manifest alone cannot tell
    with pytest.raises(InputError, match="weights_only") as err:
        load_run(path)
    assert str(path / SHARDS[stage]) in str(err.value)
    assert not flag.exists(), "the payload ran"
