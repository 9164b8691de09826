"""``build_run_data`` on two real gloo ranks: each rank trains on its own batches, a tokenizer that rank 0 cannot
prepare fails every rank with a reason, and a tokenizer or block build past ``train.data_build_timeout_s`` fails the rank
that waits for it naming that key (the one-process side is ``tests/unit/test_run_data.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_helpers import run_ranks

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.distributed


def _build(rank: int, world_size: int, out: str, cache: str, rank0: str, *overrides: str) -> dict:
    """``build_run_data`` with rank 0's part as ``rank0`` says (``ok``, its tokenizer ``fails``, its tokenizer or
    its blocks ``slow``); the error each rank raised, or its first training batch."""
    import time

    from torch.distributed import distributed_c10d

    from comera_dist.config import load_run_config
    from comera_dist.data.errors import DataError
    from comera_dist.engine import run_data
    from comera_dist.engine.distributed import init_distributed

    cfg = load_run_config(REPO / "configs/tiny-cpu.yaml", [f"train.output_dir={out}", f"data.cache_dir={cache}",
                                                           "data.max_files=12", *overrides])
    name = "prepare_data" if rank0 == "slow blocks" else "prepare_tokenizer"
    prepare = getattr(run_data, name)

    def rank0s(*args, **kwargs):
        if rank0 == "fails":
            raise DataError("data.tokenizer: the corpus has no text to train it on")
        time.sleep(12)
        return prepare(*args, **kwargs)

    if rank == 0 and rank0 != "ok":
        setattr(run_data, name, rank0s)
    info = init_distributed(cfg.train.process_group_timeout_s)
    groups = len(distributed_c10d._world.pg_map)  # torch has no public count of a process's groups
    start = time.monotonic()
    try:
        data = run_data.build_run_data(cfg, info)
    except Exception as e:  # noqa: BLE001 - what each rank raised is the result
        return {"error": f"{type(e).__name__}: {e}", "waited_s": time.monotonic() - start}
    first = next(data.train)["input_ids"].tolist()
    data.train.close()
    return {"first": first, "digest": data.tokenizer_digest,
            "groups_left": len(distributed_c10d._world.pg_map) - groups}


def test_each_rank_trains_on_its_own_batches_of_one_tokenizer(tmp_path):
    results = run_ranks(_build, tmp_path / "w", str(tmp_path / "run"), str(tmp_path / "cache"), "ok")
    assert results[0]["digest"] == results[1]["digest"]
    assert results[0]["first"] != results[1]["first"]
    assert [r["groups_left"] for r in results] == [0, 0], results  # the build's gloo group is destroyed after it


def test_a_tokenizer_rank_0_cannot_prepare_fails_every_rank_with_a_reason(tmp_path):
    results = run_ranks(_build, tmp_path / "w", str(tmp_path / "run"), str(tmp_path / "cache"), "fails")
    assert results[0]["error"] == "InputError: data.tokenizer: the corpus has no text to train it on", results
    assert results[1]["error"] == "InputError: rank 0 could not prepare the run's tokenizer (its log says why)", results


@pytest.mark.parametrize("slow", ["slow tokenizer", "slow blocks"])
def test_a_data_build_past_its_timeout_fails_the_waiting_rank_naming_the_key(tmp_path, slow):
    results = run_ranks(_build, tmp_path / "w", str(tmp_path / "run"), str(tmp_path / "cache"), slow,
                        "train.data_build_timeout_s=3", "train.process_group_timeout_s=60")
    assert results[1]["error"].startswith("InputError: "), results
    assert "train.data_build_timeout_s=3" in results[1]["error"], results
    assert results[1]["waited_s"] < 11, results  # the 3 s it allows, not rank 0's 12 s build nor the job's 60 s
