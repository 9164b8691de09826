"""One rank's data (``engine/run_data.py``) in a one-process job: the tokenizer a resume keeps, the batches of a
step and of an evaluation, and the model/data checks before and after the build. The collectives of a
multi-rank build are ``tests/distributed/test_run_tokenizer.py``'s."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist

from comera_dist.config import load_run_config
from comera_dist.data.prepare import prepare_tokenizer
from comera_dist.data.tokenizer import load_tokenizer, save_run_tokenizer, tokenizer_digest
from comera_dist.engine import checkpoint as ckpt
from comera_dist.engine.distributed import DistInfo
from comera_dist.engine.errors import InputError
from comera_dist.engine.run_data import build_run_data, resume_tokenizer_dir

REPO = Path(__file__).resolve().parents[2]
ALONE = DistInfo(rank=0, world_size=1, local_rank=0, source="single")


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    """A one-process job has its process group too (``init_distributed``): the build waits at its barrier."""
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    yield
    tdist.destroy_process_group()


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def _cfg(tmp_path: Path, cache: Path, *overrides: str):
    return load_run_config(REPO / "configs/tiny-cpu.yaml", [
        f"train.output_dir={tmp_path / 'run'}", f"data.cache_dir={cache}", "data.max_files=12",
        "metrics.prometheus=false", *overrides])


@pytest.fixture
def built(tmp_path, cache):
    made = []

    def build(*overrides: str, tokenizer_dir: Path | None = None):
        made.append(build_run_data(_cfg(tmp_path, cache, *overrides), ALONE, tokenizer_dir=tokenizer_dir))
        return made[-1]

    yield build
    for data in made:
        data.train.close()


def _checkpoint(root: Path, tag: str) -> None:
    (root / tag).mkdir(parents=True)
    for name in (ckpt.MARKER, ckpt.META):
        (root / tag / name).write_text("{}")


def test_a_resume_keeps_the_tokenizer_of_the_run_whose_checkpoints_it_continues(tmp_path, monkeypatch):
    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    assert resume_tokenizer_dir(run, "auto") is None  # a fresh start that crashed before any checkpoint
    (run / "checkpoints" / f"{ckpt.TMP_PREFIX}step00000004").mkdir(parents=True)
    # a crash between a save's two renames: the resume publishes that checkpoint and goes on from it
    assert resume_tokenizer_dir(run, "auto") == run / "tokenizer"
    _checkpoint(run / "checkpoints", "step00000002")
    assert resume_tokenizer_dir(run, "auto") == run / "tokenizer"
    _checkpoint(tmp_path / "none", "step00000002")
    (tmp_path / "tokenizer").mkdir()
    monkeypatch.chdir(tmp_path)  # "none" is a fresh start, never the checkpoints directory of that name
    assert resume_tokenizer_dir(run, "none") is None
    other = tmp_path / "other"  # --resume PATH: a checkpoints directory or one checkpoint, of another run
    _checkpoint(other / "checkpoints", "step00000003")
    (other / "tokenizer").mkdir()
    assert resume_tokenizer_dir(run, str(other / "checkpoints")) == other / "tokenizer"
    assert resume_tokenizer_dir(run, str(other / "checkpoints" / "step00000003")) == other / "tokenizer"
    (other / "tokenizer").rmdir()
    assert resume_tokenizer_dir(run, str(other / "checkpoints")) is None  # none to keep: the configured one


def test_a_step_takes_one_micro_batch_per_accumulation_step_and_counts_every_ranks_tokens(built):
    data = built("deepspeed.gradient_accumulation_steps=3")
    step = data.next_train_batches()
    assert [tuple(b["input_ids"].shape) for b in step] == [(4, 32)] * 3
    assert not torch.equal(step[0]["input_ids"], step[1]["input_ids"])
    assert data.tokens_per_step == 4 * 3 * 32
    assert dataclasses.replace(data, info=DistInfo(1, 2, 1, "env")).tokens_per_step == 4 * 3 * 2 * 32


def test_the_training_order_follows_the_seed(built):
    first = [built(f"train.seed={seed}").next_train_batches()[0]["input_ids"] for seed in (1, 2, 1)]
    assert torch.equal(first[0], first[2]) and not torch.equal(first[0], first[1])


def test_the_ranks_share_the_configured_validation_pass_and_see_the_same_blocks_every_time(built):
    data = built("train.eval_batches=2")  # 2 * micro_batch blocks in all, whatever the world size
    assert len(data.prepared.validation) > 2 * data.micro_batch  # the pass is a prefix, not the whole split

    def blocks(rank, world):
        at = dataclasses.replace(data, info=DistInfo(rank, world, rank, "env"))
        return [b["input_ids"] for b in at.validation_batches()]

    alone = blocks(0, 1)
    assert len(alone) == 2
    ranks = [blocks(r, 2) for r in (0, 1)]
    assert [len(batches) for batches in ranks] == [1, 1]  # half the pass each, not 2 batches a rank
    assert torch.equal(torch.cat(ranks[0] + ranks[1]), torch.cat(alone))
    for a, b in zip(ranks[0], blocks(0, 2), strict=True):
        assert torch.equal(a, b)


def test_a_model_vocabulary_smaller_than_the_configured_tokenizers_is_refused_before_the_build(tmp_path, built):
    with pytest.raises(InputError, match=r"model vocab_size=256 is smaller than data.tokenizer.vocab_size=512"):
        built("model.vocab_size=256", f"data.cache_dir={tmp_path / 'unbuilt'}")
    assert not (tmp_path / "unbuilt").exists() or not any((tmp_path / "unbuilt").iterdir())


def test_a_kept_tokenizer_is_the_runs_and_is_checked_against_the_model(tmp_path, cache, built):
    small = ("model.vocab_size=300", "data.tokenizer.vocab_size=300")
    for name, overrides in (("small", small), ("large", ())):
        save_run_tokenizer(prepare_tokenizer(_cfg(tmp_path, cache, *overrides).data, show_progress=False),
                           tmp_path / name)
    kept = built(tokenizer_dir=tmp_path / "small")
    assert kept.tokenizer_digest == tokenizer_digest(load_tokenizer(tmp_path / "small"))
    assert kept.tokenizer_digest != built().tokenizer_digest  # the configured one
    with pytest.raises(InputError, match=r"model vocab_size=300 is smaller than the tokenizer's vocabulary"):
        built(*small, tokenizer_dir=tmp_path / "large")
