"""``TrainSession``'s own decisions around a real DeepSpeed engine at ZeRO 0 (one process, a gloo group of one:
the ``engine`` fixture of tests/unit/conftest.py holds it), with a five-weight model, so each decision is
asserted exactly: how many micro-batches a step takes, what a skipped step counts, the gradient norm it reports
when DeepSpeed reports none (nan) or its -1 sentinel (bf16 without the overflow check: the run stops), an
evaluation without a label token (nan, not a perfect score), and the steps at which ``maybe_prune`` prunes
(``compression.pruning.prune_due``). The norms DeepSpeed would report are set on the engine (its
``get_global_grad_norm``); the 2-rank engines with TT models are tests/distributed's.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import deepspeed
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from comera_dist.compression.config import PruningConfig
from comera_dist.compression.pruning import prune_due
from comera_dist.config import load_run_config
from comera_dist.engine import session as session_mod
from comera_dist.engine.build import Built
from comera_dist.engine.session import NonFiniteGradientsApplied, TrainSession

REPO = Path(__file__).resolve().parents[2]
VOCAB = 5


class _Model(nn.Module):
    """Logits ``x * w`` over a vocabulary of 5, the MLM-style loss over the label tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(VOCAB))

    def forward(self, x, labels):
        logits = x * self.w  # (B, T, V)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100), "logits": logits}


pytestmark = pytest.mark.usefixtures("engine")  # the conftest's engine: its one-process group is what is used


def _session(tmp_path: Path, *overrides: str, accumulation: int = 2, grad_norm="deepspeed") -> TrainSession:
    """A session on a fresh ZeRO-0 DeepSpeed engine in the module's process group; ``grad_norm``: the norm the
    engine reports, else DeepSpeed's own (None: no clipping configured)."""
    cfg = load_run_config(REPO / "configs/tiny-cpu.yaml", [
        f"train.output_dir={tmp_path / 'run'}", "deepspeed.zero_stage=0",
        f"deepspeed.gradient_accumulation_steps={accumulation}", "metrics.prometheus=false", *overrides])
    model = _Model()
    engine, optimizer, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                                 config={"train_micro_batch_size_per_gpu": 2,
                                                         "gradient_accumulation_steps": accumulation,
                                                         "zero_optimization": {"stage": 0}})
    if grad_norm != "deepspeed":
        engine.get_global_grad_norm = lambda: grad_norm
    built = Built(engine=engine, optimizer=optimizer, scheduler=None, ds_config={}, group_names=[])
    return TrainSession(cfg, _Model, built, world_size=1)


def _batch(seed: int, *, poison: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, VOCAB, generator=g)  # (B, T, V)
    if poison:
        x[0, 0, 0] = float("nan")
    return {"x": x, "labels": torch.randint(0, VOCAB, (2, 3), generator=g)}


def test_a_step_takes_exactly_the_configured_micro_batches(tmp_path):
    s = _session(tmp_path, accumulation=2)
    for given in ([_batch(1)], [_batch(1), _batch(2), _batch(3)]):
        with pytest.raises(ValueError, match=rf"got {len(given)} micro-batches, the config accumulates 2"):
            s.train_step(given)
    assert s.engine.micro_steps == 0 and s.steps_done == 0  # refused before any forward
    out = s.train_step([_batch(1), _batch(2)])
    assert not out.skipped_nonfinite and s.engine.global_steps == 1 and s.steps_done == 1


def test_a_step_without_a_reported_gradient_norm_says_nan(tmp_path):
    """ZeRO 0's plain optimizer path records no norm (DeepSpeed's ``None``): the session reports nan, not a
    norm of 0; a norm DeepSpeed reports comes through as it is."""
    s = _session(tmp_path)
    with torch.no_grad():
        want = sum(float(s.module(**_batch(i))["loss"]) for i in (1, 2)) / 2  # the micro-batches' mean loss
    out = s.train_step([_batch(1), _batch(2)])
    assert math.isnan(out.grad_norm) and out.task_loss == pytest.approx(want)
    assert _session(tmp_path, grad_norm=2.5).train_step([_batch(1), _batch(2)]).grad_norm == 2.5


def test_a_skipped_step_counts_as_a_step_and_as_a_nonfinite_one(tmp_path):
    """A non-finite micro-batch skips the whole step (the probe finds it before any backward): nothing is applied,
    and both counters move, so the next step is the run's second (the rank controller's step, saved in a checkpoint)."""
    s = _session(tmp_path)
    w = s.module.w.detach().clone()
    out = s.train_step([_batch(1), _batch(2, poison=True)])
    assert out.skipped_nonfinite and math.isnan(out.task_loss) and math.isnan(out.grad_norm)
    assert (s.steps_done, s.nonfinite_total, s.engine.global_steps) == (1, 1, 0)
    assert torch.equal(s.module.w, w) and s.module.w.grad is None
    assert not s.train_step([_batch(3), _batch(4)]).skipped_nonfinite
    assert (s.steps_done, s.nonfinite_total, s.engine.global_steps) == (2, 1, 1)


@pytest.mark.parametrize("norm", [-1.0, float("nan"), float("inf"), torch.tensor(float("inf"))],
                         ids=["sentinel", "nan", "inf", "tensor-inf"])
def test_unchecked_bf16_stops_on_a_nonfinite_gradient_norm_and_its_sentinel(tmp_path, norm):
    """bf16 at ZeRO 1 without DeepSpeed's overflow check: nothing skipped the step, so a gradient norm that is
    not finite, or DeepSpeed's -1 for one, means corrupt weights: the session raises. A finite norm does not."""
    args = ("deepspeed.zero_stage=1", "deepspeed.precision=bf16", "deepspeed.bf16_overflow_check=false")
    s = _session(tmp_path, *args, grad_norm=norm)
    assert s.bf16_unchecked
    with pytest.raises(NonFiniteGradientsApplied, match="the gradients were not finite"):
        s.train_step([_batch(1), _batch(2)])
    assert _session(tmp_path, *args, grad_norm=0.0).train_step([_batch(1), _batch(2)]).grad_norm == 0.0


def test_an_evaluation_without_a_label_token_is_nan_not_a_perfect_score(tmp_path):
    s = _session(tmp_path)
    unlabelled = {**_batch(1), "labels": torch.full((2, 3), -100)}
    loss, accuracy = s.evaluate([unlabelled])
    assert math.isnan(loss) and math.isnan(accuracy)
    loss, accuracy = s.evaluate([_batch(1)])
    with torch.no_grad():
        want = s.module(**_batch(1))
    assert loss == pytest.approx(float(want["loss"]))
    assert accuracy == float((want["logits"].argmax(-1) == _batch(1)["labels"]).double().mean())


class _Pruned(Exception):
    """Raised where ``maybe_prune`` begins a prune (the full-state gather): it was due at that step."""


@pytest.mark.parametrize(("every", "start"), [(3, 0), (4, 5), (1, 8), (4, 2), (0, 0)])
def test_maybe_prune_prunes_at_the_pruning_schedule(tmp_path, monkeypatch, every, start):
    """``comera.pruning``'s schedule is ``prune_due``'s (every ``every`` steps counted from ``start_step``),
    the one the benchmarks and the docs use: a start that is not a multiple of ``every`` still prunes there."""
    s = _session(tmp_path, f"comera.pruning.every={every}", f"comera.pruning.start_step={start}")
    s.penalty = SimpleNamespace(active=True)  # a tensorized model's

    def gather(engine):
        raise _Pruned

    monkeypatch.setattr(session_mod, "gather_full_state", gather)
    due = []
    for step in range(1, 13):
        try:
            s.maybe_prune(step)
        except _Pruned:
            due.append(step)
    cfg = PruningConfig(every=every, start_step=start)
    assert due == [step for step in range(1, 13) if prune_due(cfg, step)]
    assert due == {(3, 0): [3, 6, 9, 12], (4, 5): [5, 9], (1, 8): [8, 9, 10, 11, 12], (4, 2): [2, 6, 10],
                   (0, 0): []}[(every, start)]


def test_a_dense_model_never_prunes(tmp_path, monkeypatch):
    s = _session(tmp_path, "comera.pruning.every=1", "comera.pruning.start_step=0")
    assert not s.penalty.active and s.size() == 0  # no gate: S is 0
    monkeypatch.setattr(session_mod, "gather_full_state", lambda engine: pytest.fail("a dense model gathered"))
    assert not any(s.maybe_prune(step) for step in range(1, 5))
