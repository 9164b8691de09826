"""The run's tokenizer is global rank 0's on every rank, and a resumed run keeps its own.

The ``tokenizers`` WordPiece trainer picks and numbers tokens in hash-map order, different in every process
(huggingface/tokenizers#1794): two nodes that each trained one on the same corpus encoded the same text with
other ids. Real ``comera pretrain`` processes; each rank here is local rank 0 of its own "node" with its own
cache, as on a cluster with node-local caches.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from dist_helpers import run_ranks

from comera_dist.data.tokenizer import load_tokenizer, tokenizer_digest
from comera_dist.engine.ports import free_port

REPO = Path(__file__).resolve().parents[2]
WORDPIECE = ["--set", "data.tokenizer.kind=wordpiece", "--set", "train.steps=2", "--set", "train.checkpoint_every=2",
             "--set", "metrics.prometheus=false", "--set", "train.eval_every=0"]

pytestmark = pytest.mark.distributed


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(COMERA_CACHE=str(cache), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update(extra)
    return env


def _pretrain(out: Path, env: dict[str, str], *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "comera_dist.cli", "pretrain", "--config", "configs/tiny-cpu.yaml",
                             "--set", f"train.output_dir={out}", *WORDPIECE, *extra], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _pretrain_ranks(out: Path, caches: list[Path], *extra: str) -> list[tuple[int, str]]:
    """``comera pretrain`` on two ranks, each local rank 0 of its own "node" with its own cache; (exit code,
    log) of each."""
    port = free_port()
    procs = [_pretrain(out, _env(cache, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                                 MASTER_PORT=str(port)), *extra) for rank, cache in enumerate(caches)]
    logs = [p.communicate(timeout=400)[0] for p in procs]
    return [(p.returncode, log) for p, log in zip(procs, logs, strict=True)]


def _blocks(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name.startswith("blocks-"))


def test_nodes_with_their_own_caches_pack_with_rank_0s_tokenizer(tmp_path, port):
    caches = [tmp_path / "node0-cache", tmp_path / "node1-cache"]
    procs = [_pretrain(tmp_path / "run", _env(caches[rank], RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0",
                                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
             for rank in (0, 1)]
    logs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-3000:] for log in logs)
    # node 1 never trained a tokenizer, and packed its corpus with rank 0's: the blocks entry of the same digest
    assert [p.name.split("-")[0] for p in caches[1].iterdir() if p.name.startswith("tokenizer-")] == []
    assert _blocks(caches[0]) == _blocks(caches[1]) and len(_blocks(caches[0])) == 1
    import datasets
    rows = [datasets.load_from_disk(str(c / _blocks(c)[0]))["train"]["input_ids"][:8] for c in caches]
    assert rows[0] == rows[1]


def test_a_resume_with_empty_caches_keeps_the_runs_tokenizer(tmp_path):
    """A Slurm requeue onto nodes whose caches are empty: the run's tokenizer is kept on both, not trained again."""
    out = tmp_path / "run"
    for code, log in _pretrain_ranks(out, [tmp_path / "a0", tmp_path / "a1"]):
        assert code == 0, log[-3000:]
    saved = tokenizer_digest(load_tokenizer(out / "tokenizer"))
    again = _pretrain_ranks(out, [tmp_path / "b0", tmp_path / "b1"], "--set", "train.steps=4")
    for code, log in again:
        assert code == 0, log[-3000:]
        assert "resumed at step 2" in log and "tokenizer: trained" not in log, log[-3000:]
    assert tokenizer_digest(load_tokenizer(out / "tokenizer")) == saved
    for node in ("b0", "b1"):  # both packed the corpus with the run's tokenizer, none trained one
        assert not [p for p in (tmp_path / node).iterdir() if p.name.startswith("tokenizer-")]
        assert len(_blocks(tmp_path / node)) == 1 and _blocks(tmp_path / node) == _blocks(tmp_path / "a0")


def test_a_resume_with_another_tokenizer_is_refused(tmp_path):
    """The checkpoint records its tokenizer's digest: with the run's tokenizer replaced by another (an older
    run directory, a hand copy), the resume is one clear line and exit 2 on every rank, not a model fed other
    ids."""
    out, caches = tmp_path / "run", [tmp_path / "c0", tmp_path / "c1"]
    for code, log in _pretrain_ranks(out, caches):
        assert code == 0, log[-3000:]
    other = _pretrain(tmp_path / "other", _env(tmp_path / "c0"), "--set", "data.tokenizer.vocab_size=500",
                      "--set", "train.steps=1", "--set", "train.checkpoint_every=0")
    assert other.wait(timeout=400) == 0, other.stdout.read()[-3000:]
    (out / "tokenizer").rename(tmp_path / "kept")
    (tmp_path / "other" / "tokenizer").rename(out / "tokenizer")
    for code, log in _pretrain_ranks(out, caches, "--set", "train.steps=4"):
        assert code == 2, log[-3000:]
        assert "resume: the checkpoint was trained with another tokenizer" in log, log[-3000:]


def _slow_build(rank: int, world_size: int, out: str, cache: str) -> dict:
    """``build_run_data`` with rank 0's tokenizer taking 3x the job's collective timeout (a large corpus's
    first build, sped up): the other rank waits in the build group (``train.data_build_timeout_s``)."""
    import time

    from comera_dist.config import load_run_config
    from comera_dist.engine import run_data
    from comera_dist.engine.distributed import init_distributed

    cfg = load_run_config(REPO / "configs/tiny-cpu.yaml", [f"train.output_dir={out}", f"data.cache_dir={cache}",
                                                           "train.process_group_timeout_s=2"])
    prepare = run_data.prepare_tokenizer

    def slow(*args, **kwargs):
        time.sleep(6)
        return prepare(*args, **kwargs)

    run_data.prepare_tokenizer = slow
    info = init_distributed(cfg.train.process_group_timeout_s)
    data = run_data.build_run_data(cfg, info)
    return {"digest": data.tokenizer_digest, "first": list(data.prepared.train["input_ids"][0][:8])}


def test_the_other_ranks_wait_for_a_data_build_longer_than_the_collective_timeout(tmp_path):
    results = run_ranks(_slow_build, tmp_path / "w", str(tmp_path / "run"), str(tmp_path / "cache"))
    assert results[0] == results[1], results
