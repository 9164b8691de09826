"""Pure-logic tests of the pieces the failure tests drive through real jobs: the fault-injection
hook, the non-finite guard and the stop-signal flag (no process group, milliseconds)."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time

import pytest
import torch
from torch import nn

from comera_dist.compression.controller import InputEmbeddingDead, RanksCollapsed
from comera_dist.engine.faults import NonFiniteInjector, parse_steps
from comera_dist.engine.signals import START_SIGNALS, STOP_SIGNALS, StopRequest
from comera_dist.engine.trainer import NonFiniteGuard, _due, _eta, _why_dead


def test_parse_steps():
    assert parse_steps("") == set()
    assert parse_steps("3, 5-7,9") == {3, 5, 6, 7, 9}
    for bad in ("x", "0", "5-3", "2-"):
        with pytest.raises(ValueError, match="COMERA_FAULT_NONFINITE_STEPS"):
            parse_steps(bad)


class _Toy(nn.Module):
    def forward(self, x):
        return {"loss": x.sum(), "logits": x}


def test_injector_poisons_only_armed_training_steps_on_chosen_ranks():
    env = {"COMERA_FAULT_NONFINITE_STEPS": "2", "COMERA_FAULT_RANKS": "0"}
    model = _Toy()
    inj = NonFiniteInjector(rank=0, environ=env)
    inj.attach(model)
    x = torch.ones(3)
    inj.arm(1)
    assert model(x)["loss"].item() == 3.0
    inj.arm(2)
    out = model(x)
    assert math.isnan(out["loss"].item()) and torch.equal(out["logits"], x)
    inj.arm(2, training=False)  # evaluation inside a poisoned step is never touched
    assert model(x)["loss"].item() == 3.0
    other = NonFiniteInjector(rank=1, environ=env)
    assert not other.enabled_here
    assert not NonFiniteInjector(rank=0, environ={}).enabled_here
    with pytest.raises(ValueError, match="COMERA_FAULT_RANKS"):
        NonFiniteInjector(rank=0, environ={"COMERA_FAULT_NONFINITE_STEPS": "1", "COMERA_FAULT_RANKS": "a"})


def test_injector_grad_kind_keeps_the_loss_and_poisons_its_gradient():
    model = _Toy()
    env = {"COMERA_FAULT_NONFINITE_STEPS": "1", "COMERA_FAULT_NONFINITE_KIND": "grad"}
    inj = NonFiniteInjector(rank=0, environ=env)
    inj.attach(model)
    x = torch.ones(3, requires_grad=True)
    inj.arm(1)
    loss = model(x)["loss"]
    loss.backward()
    assert loss.item() == 3.0 and torch.isnan(x.grad).all()
    with pytest.raises(ValueError, match="COMERA_FAULT_NONFINITE_KIND='weights': must be one of loss, grad"):
        NonFiniteInjector(rank=0, environ={"COMERA_FAULT_NONFINITE_KIND": "weights"})


def test_nonfinite_guard_counts_consecutive_and_total():
    g = NonFiniteGuard(limit=3)
    for skipped in (True, False, True, True):
        g.update(skipped)
        assert not g.tripped
    assert (g.consecutive, g.total) == (2, 3)
    g.update(True)
    assert g.tripped and g.total == 4


def test_due_schedule():
    assert [s for s in range(1, 11) if _due(s, 3, 10)] == [3, 6, 9, 10]
    assert [s for s in range(1, 11) if _due(s, 0, 10)] == [10]


def test_eta_is_the_mean_step_time_times_the_steps_left():
    assert _eta(10.0, 5, 25) == "0:00:50"
    assert _eta(3.0, 1, 1234) == "1:01:42"
    assert _eta(1.0, 0, 3) == "0:00:03"  # never divides by zero


def _signal_self(sig: signal.Signals, stop: StopRequest) -> None:
    """Send ``sig`` to this process and wait (at most 5 s) for ``stop``'s handler. The main thread blocks the
    watched signals, so the kernel delivers them to the receiver thread, and the main thread runs the Python
    handler at its next bytecode rather than before ``kill`` returns."""
    seen = stop.signal_name
    os.kill(os.getpid(), sig)
    deadline = time.monotonic() + 5
    while seen is None and stop.signal_name is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # a second signal, whose handler keeps the first name, has no change to wait for


def test_stop_request_records_signal_and_restores_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    stop = StopRequest()
    assert not stop.requested and not stop.agree()
    _signal_self(signal.SIGUSR1, stop)
    assert stop.requested and stop.signal_name == "SIGUSR1" and stop.agree()
    _signal_self(signal.SIGTERM, stop)
    assert stop.signal_name == "SIGUSR1"  # the first one is kept
    stop.close()
    assert signal.getsignal(signal.SIGUSR1) == before
    assert not set(STOP_SIGNALS) & signal.pthread_sigmask(signal.SIG_BLOCK, [])  # unblocked again


def test_a_child_started_while_watching_outlives_the_stop_signal():
    """Slurm signals every process of the step: a child of the trainer (ptxas, a compile worker) died of the
    default action. Started after ``watch``, it inherits the signals blocked; the trainer still records them."""
    stop = StopRequest()
    try:
        child = subprocess.Popen(["sleep", "30"])
        try:
            for sig in STOP_SIGNALS:
                child.send_signal(sig)  # as scancel --signal: each process of the step
            _signal_self(signal.SIGUSR1, stop)
            time.sleep(0.5)
            assert child.poll() is None, f"the child died of a stop signal: {child.returncode}"
            assert stop.signal_name == "SIGUSR1"
        finally:
            child.kill()
            child.wait()
    finally:
        stop.close()
    after = subprocess.Popen(["sleep", "30"])  # closed: children get the signals again
    after.send_signal(signal.SIGUSR1)
    assert after.wait(timeout=10) == -signal.SIGUSR1


def test_stop_request_watches_more_signals_later_and_restores_the_first_handlers():
    """The trainer's order: USR1 from the start of the job, SIGTERM once there is a state to save."""
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    stop = StopRequest(START_SIGNALS)
    assert signal.getsignal(signal.SIGTERM) == before[signal.SIGTERM]  # a starting rank still dies of TERM
    stop.watch(STOP_SIGNALS)  # USR1 again: its first previous handler is the one kept
    _signal_self(signal.SIGTERM, stop)
    assert stop.signal_name == "SIGTERM"
    stop.close()
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before


def test_a_dead_input_embedding_stops_the_run_and_a_dead_projection_does_not():
    """A TT embedding with a bond of no rank alive maps every token to zero: the model cannot train on
    (``InputEmbeddingDead``, which the trainer's exit 4 catches as a collapse). A dead bond of a projection, or an
    embedding whose bonds all live, is a compression; S = 0 is the collapse whatever the embedding."""
    live = {"blocks.0.attn.out": {"kind": "TTLinear", "ranks": [0, 1]},
            "other.table": {"kind": "TTEmbedding", "ranks": [1, 1, 1]}}
    assert _why_dead({"layers": live, "size": 10}) is None
    dead = _why_dead({"layers": {**live, "embeddings.word": {"kind": "TTEmbedding", "ranks": [1, 0, 2]}}, "size": 10})
    assert isinstance(dead, InputEmbeddingDead) and isinstance(dead, RanksCollapsed)
    assert str(dead).startswith("embeddings.word has a bond with no rank alive (ranks [1, 0, 2])")
    assert "comera.controller.embedding_tau" in str(dead)
    collapsed = _why_dead({"layers": {"embeddings.word": {"kind": "TTEmbedding", "ranks": [0, 0, 0]}}, "size": 0})
    assert type(collapsed) is RanksCollapsed
    assert _why_dead({"layers": {}, "size": 0}) is None  # a dense model: no rank to collapse
