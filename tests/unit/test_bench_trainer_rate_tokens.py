"""``bench trainer-rate`` counts a trainer step's tokens as the trainer does: micro-batch x gradient accumulation x
world size x sequence length, so its loop rate and its rows' seconds per step are right with accumulation."""

import math

import pytest

from comera_dist.bench.trainer_rate import (
    SMOKE_CONFIG,
    SMOKE_SETS,
    loop_tokens_per_s,
    rate_rows,
    trainer_tokens_per_step,
)
from comera_dist.config import load_run_config


def test_a_trainer_step_with_accumulation_4_counts_every_micro_batch():
    cfg = load_run_config(SMOKE_CONFIG, [*SMOKE_SETS, "deepspeed.gradient_accumulation_steps=4"])
    micro, seq = cfg.deepspeed.micro_batch_size_per_gpu, cfg.data.seq_len  # 4, 32
    tokens = trainer_tokens_per_step(cfg)
    assert tokens == micro * 4 * seq == 512
    assert trainer_tokens_per_step(cfg, world_size=2) == 2 * tokens
    # steps start every 0.5 s (one late start, which the median ignores): 512 tokens / 0.5 s
    assert loop_tokens_per_s(tokens, [0.0, 0.5, 1.0, 1.5, 2.5]) == pytest.approx(1024.0)
    assert math.isnan(loop_tokens_per_s(tokens, [1.0]))  # a single step has no interval


def test_the_rows_give_each_contender_its_own_step():
    # bare step: 128 tokens in 0.1 s; the session and the trainer step 4 micro-batches of 128 tokens each
    bench = {"tokens_per_step": 128, "step_s": 0.1}
    session = {"micro_batches": 4, "step_s": 0.5}
    trainer = {"tokens_per_step": 512, "tokens_per_s": 1024.0, "loop_tokens_per_s": 512.0}
    rows = {r["contender"]: r for r in rate_rows(bench, session, trainer, graph_tps=2560.0)}
    assert rows["bench (bare CoMERA step)"]["tokens_per_s"] == pytest.approx(1280.0)
    assert rows["bench, one CUDA graph"]["step_s"] == pytest.approx(0.05)
    assert rows["session step (DeepSpeed, fixed batch)"]["tokens_per_s"] == pytest.approx(1024.0)
    assert rows["session step (DeepSpeed, fixed batch)"]["step_s"] == pytest.approx(0.5)
    assert rows["trainer (its tokens_per_second)"]["step_s"] == pytest.approx(0.5)  # 512 tokens at 1024 tokens/s
    assert rows["trainer loop (wall)"]["step_s"] == pytest.approx(1.0)
    assert "bench, one CUDA graph" not in {r["contender"] for r in rate_rows(bench, session, trainer, None)}
