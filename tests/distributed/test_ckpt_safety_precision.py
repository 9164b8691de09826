"""Resuming at another ``deepspeed.precision`` than the checkpoint's (fp32 <-> bf16 at ZeRO 1 and 2).

DeepSpeed names its optimizer shards by precision (``bf16_zero_pp_rank_*`` under bf16, ``zero_pp_rank_*``
under fp32), so its own loader cannot cross; the checkpoint's meta records its precision and such a resume
takes the consolidated state (``engine/elastic.py``), fp32 masters and all. A checkpoint that predates the
record and meets the other precision fails with an error naming the shard and the remedy, not DeepSpeed's
raw ``FileNotFoundError``. Two ranks: each one's partition of the fp32 masters must come back from the
consolidated state.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from checkpoint_testlib import revouch
from dist_helpers import run_ranks
from engine_cases import batch, factory, full_params, tiny_config

MOVES = [(1, "fp32", "bf16"), (2, "bf16", "fp32")]


def _save(outdir: str, stage: int, precision: str, rank: int, world_size: int) -> tuple[Path, dict]:
    from comera_dist.engine.session import TrainSession

    cfg = tiny_config(outdir, zero_stage=stage, steps=4, precision=precision)
    s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
    for step in (1, 2):
        s.train_step([batch(step, rank)])
    saved = {n: t.clone() for n, t in full_params(s).items()}  # the fp32 masters
    path = s.save(2)
    s.close()
    return path, saved


def _resume(outdir: str, stage: int, precision: str, rank: int, world_size: int) -> dict:
    from comera_dist.engine.checkpoint import CheckpointError
    from comera_dist.engine.session import TrainSession

    cfg = tiny_config(outdir, zero_stage=stage, steps=4, precision=precision)
    s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
    try:
        client = s.resume("auto")
    except CheckpointError as e:
        s.close()
        return {"error": str(e)}
    except Exception as e:  # noqa: BLE001 - DeepSpeed's raw error is what the test must not see
        s.close()
        return {"error": f"{type(e).__name__}: {e}", "raw": True}
    out = {"client_step": client["step"], "params": full_params(s), "loss": s.train_step([batch(3, rank)]).task_loss}
    s.close()
    return out


def _strip_precision(path: Path) -> None:
    """``path`` as a checkpoint written before the meta recorded its precision (manifest re-rendered)."""
    from comera_dist.engine import checkpoint as ckpt

    meta = json.loads((path / ckpt.META).read_text())
    meta.pop("precision", None)
    (path / ckpt.META).write_text(json.dumps(meta, indent=2))
    revouch(path)


def _cases(rank: int, world_size: int, outdir: str) -> dict:
    import deepspeed.comm as dist

    from comera_dist.engine import checkpoint as ckpt
    from comera_dist.engine.distributed import init_distributed

    init_distributed(60)
    out = {}
    for stage, before, after in MOVES:
        run = f"{outdir}/z{stage}-{before}-{after}"
        path, saved = _save(run, stage, before, rank, world_size)
        out[(stage, before, after)] = {"meta": ckpt.read_meta(path).get("precision"), "saved": saved,
                                       **_resume(run, stage, after, rank, world_size)}
    legacy = f"{outdir}/legacy"
    path, _ = _save(legacy, 1, "fp32", rank, world_size)
    if rank == 0:
        _strip_precision(path)
    dist.barrier()
    out["legacy"] = _resume(legacy, 1, "bf16", rank, world_size)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("precision_move")
    return run_ranks(_cases, tmp / "w", str(tmp / "runs"), world_size=2)


@pytest.mark.parametrize("stage,before,after", MOVES)
def test_a_precision_change_resumes_from_the_consolidated_state(results, stage, before, after):
    for rank, r in enumerate(results):
        got = r[(stage, before, after)]
        assert "error" not in got, got["error"]
        assert got["meta"] == before and got["client_step"] == 2 and math.isfinite(got["loss"])
        assert got["params"].keys() == got["saved"].keys()
        for name, want in got["saved"].items():  # the fp32 masters, not the bf16 working copy, came back
            assert got["params"][name].equal(want), (rank, name)  # gathered from both ranks' partitions


def test_a_checkpoint_without_its_precision_fails_naming_the_shard_and_the_remedy(results):
    for r in results:
        got = r["legacy"]
        assert "raw" not in got and "error" in got, got
        assert "bf16_zero_pp_rank_" in got["error"] and "_mp_rank_00_optim_states.pt" in got["error"]
        assert "deepspeed.precision" in got["error"]
