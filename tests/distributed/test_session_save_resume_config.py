"""``TrainSession.save`` and ``resume`` act on the config's checkpoint settings, on two real ranks.

``checkpoint.check_compatible`` and ``checkpoint.remove_old`` have their own unit tests. These tests check
that the session calls them. A mutation review of ``engine/resume.py`` found that the suite still passed
with either call removed or bypassed: a resume under a config of other shapes is refused before
DeepSpeed reads a shard, with an error naming the key and the way on, ``train.keep_every`` keeps
its multiples past ``train.keep_checkpoints``, and a shard that would run code when unpickled is refused
before DeepSpeed's own loader (``weights_only=False``) unpickles it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from checkpoint_testlib import plant_payload
from dist_helpers import run_ranks
from engine_cases import batch, tiny_config, with_overrides


def _session(outdir: str, overrides: list[str]):
    from comera_dist.engine.model_factory import build_run_model
    from comera_dist.engine.session import TrainSession

    cfg = with_overrides(tiny_config(outdir, zero_stage=1), overrides)
    return TrainSession.create(cfg, lambda: build_run_model(cfg), world_size=2)


def _run(rank: int, world_size: int, outdir: str) -> dict:
    import deepspeed.comm as dist

    from comera_dist.engine import checkpoint as ckpt
    from comera_dist.engine.distributed import init_distributed

    init_distributed(60)
    s = _session(outdir, ["train.keep_checkpoints=1", "train.keep_every=2"])
    for step in range(1, 5):
        s.train_step([batch(step, rank)])
        s.save(step)
    kept = [p.name for p in ckpt.complete_checkpoints(s.checkpoint_root)]
    s.close()
    s = _session(outdir, ["comera.tensorize.max_rank=3"])  # other core shapes than the checkpoint's
    try:
        s.resume("auto")
        refused = None
    except ckpt.CheckpointError as e:
        refused = str(e)
    s.close()
    newest, ran = ckpt.complete_checkpoints(s.checkpoint_root)[-1], f"{outdir}/code-ran"
    if rank == 0:
        plant_payload(newest, "mp_rank_00_model_states.pt", Path(ran))
    dist.barrier()
    s = _session(outdir, [])
    try:
        s.resume(str(newest))
        gate = None
    except ckpt.CheckpointError as e:
        gate = str(e)
    s.close()
    return {"kept": kept, "refused": refused, "gate": gate, "ran": Path(ran).exists(), "newest": newest.name}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("save-resume-config")
    return run_ranks(_run, tmp / "w", str(tmp / "run"))


def test_keep_every_keeps_its_multiples_past_keep_checkpoints(results):
    for out in results:
        assert out["kept"] == ["step00000002", "step00000004"], out["kept"]  # step 1 and 3 went, 2 stays


def test_a_resume_under_a_config_of_other_shapes_is_refused_naming_the_key(results):
    for out in results:  # every rank refuses alike, before any collective load
        err = out["refused"]
        assert err is not None, "resume loaded a checkpoint of other shapes"
        assert "written by an incompatible config" in err and "tensorize.max_rank: checkpoint 4 vs config 3" in err, err
        assert "or train this config in another train.output_dir" in err, err


def test_a_shard_that_would_run_code_is_refused_before_deepspeed_unpickles_it(results):
    for out in results:
        assert out["newest"] == "step00000004"
        assert not out["ran"], "resume unpickled the planted object (its code ran)"
        assert out["gate"] is not None, "resume loaded a shard holding a pickled object"
        assert "mp_rank_00_model_states.pt does not load with weights_only=True" in out["gate"], out["gate"]
