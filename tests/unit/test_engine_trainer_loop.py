"""``engine.trainer``'s loop driven with stand-ins for its components (no process group, no DeepSpeed, milliseconds).

The real jobs (tests/distributed, tests/e2e) prove the components work together; here every component is a
recorder, so each decision of the loop can be asserted exactly: which steps evaluate, log, read the ranks and
checkpoint (and the last step's checkpoint and evaluation), what rides in a checkpoint (the step, the data
position, the tokenizer digest), the non-finite stop, the stop signal, a resume past ``train.steps``, the step
time (a scripted clock: the step ends when the device has finished it) and what only rank 0 says.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch import nn

from comera_dist.config import load_run_config
from comera_dist.engine import trainer
from comera_dist.engine.distributed import DistInfo
from comera_dist.engine.errors import InputError
from comera_dist.engine.session import NonFiniteGradientsApplied, StepOutput

REPO = Path(__file__).resolve().parents[2]
DIGEST = "ab" * 32
DATA_WAIT, STEP_COMPUTE, DEVICE_TAIL = 0.5, 2.0, 1.0  # the scripted clock's seconds per step, by phase


class _Clock:
    """``time.perf_counter`` for the loop: it moves only where a stand-in says a phase took time."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Loader:
    def __init__(self, events: list) -> None:
        self.events, self.position, self.epoch, self.closed = events, 0, 2, False

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = state["position"]

    def close(self) -> None:
        self.closed = True


class _Data:
    tokens_per_step = 700
    tokenizer_digest = DIGEST

    def __init__(self, clock: _Clock, events: list) -> None:
        self.clock, self.events, self.train = clock, events, _Loader(events)
        self.saved_tokenizer: list[Path] = []

    def next_train_batches(self) -> list[dict]:
        self.clock.now += DATA_WAIT
        self.train.position += 1
        return [{"position": self.train.position}]

    def validation_batches(self):
        return iter([{"validation": 0}])

    def save_tokenizer(self, path: Path) -> None:
        self.saved_tokenizer.append(path)


class _Session:
    """What the loop calls on a ``TrainSession``; ``skip`` steps are non-finite, ``raise_at`` raises there."""

    def __init__(self, cfg, clock: _Clock, events: list, *, skip=(), raise_at=None, client=None, prune_at=(),
                 size: int = 10, gates_finite: bool = True, state_finite: bool = True) -> None:
        self.cfg, self.clock, self.events = cfg, clock, events
        self.skip, self.raise_at, self.client, self.prune_at, self.size = set(skip), raise_at, client, set(prune_at), size
        self.finite_gates, self.state_finite = gates_finite, state_finite
        self.module = nn.Linear(2, 2)
        self.engine = SimpleNamespace(compiled=0, is_compiled=False)
        self.engine.compile = lambda backend, compile_kwargs: setattr(self.engine, "compiled", self.engine.compiled + 1)
        self.steps, self.saves, self.closed = 0, [], False
        self.batches: list = []

    @property
    def checkpoint_root(self) -> Path:
        return Path(self.cfg.train.output_dir) / "checkpoints"

    def resume(self, spec: str):
        self.events.append(("resume", spec))
        return self.client

    def train_step(self, batches) -> StepOutput:
        self.steps += 1
        self.batches.append(batches)
        self.clock.now += STEP_COMPUTE
        if self.raise_at is not None and self.steps in self.raise_at:
            raise self.raise_at[self.steps]
        skipped = self.steps in self.skip
        nan = float("nan")
        return StepOutput(loss=nan if skipped else 2.0 * self.steps, task_loss=nan if skipped else float(self.steps),
                          penalty=nan if skipped else 0.25, lam=0.0, stage="early", skipped_nonfinite=skipped,
                          lr=1e-3, grad_norm=nan if skipped else 1.5)

    def compression_report(self) -> dict:
        self.events.append(("report", self.steps))
        return {"layers": {"l": {"kind": "TTLinear", "ranks": [2]}}, "size": self.size,
                "compression_ratio_model": 3.0, "compression_ratio_tensorized": 6.0, "leftover_params": 5}

    def gates_finite(self) -> bool:
        return self.finite_gates

    def ranks(self) -> dict:
        return {"l": [2]}

    def bond_dims(self) -> dict:
        return {"l": [2]}

    def maybe_prune(self, step: int) -> bool:
        return step in self.prune_at

    def evaluate(self, batches) -> tuple[float, float]:
        list(batches)
        self.events.append(("evaluate", self.steps))
        return 0.75, 0.5

    def save(self, step, client_state, *, retain, side_files, meta_fields):
        self.saves.append({"step": step, "client": client_state, "retain": retain, "side_files": side_files,
                           "meta_fields": meta_fields})
        self.events.append(("save", step))
        return self.checkpoint_root / f"step{step:08d}" if self.state_finite else None  # None: nothing written

    def close(self) -> None:
        self.closed = True
        self.events.append(("close",))


class _Metrics:
    def __init__(self, events: list, **kwargs) -> None:
        self.events, self.kwargs = events, kwargs
        self.logged: dict[int, dict] = {}
        self.ranks_at: list[int] = []
        self.saved: list[tuple[bool, int]] = []
        self.restored, self.closed, self.failed = None, False, None

    def log(self, values, step: int) -> None:
        assert step not in self.logged, f"step {step} logged twice"
        self.logged[step] = dict(values)

    def log_ranks(self, ranks, step: int) -> None:
        self.ranks_at.append(step)

    def checkpoint_saved(self, ok: bool, step: int) -> None:
        self.saved.append((ok, step))

    def history_files(self, step: int) -> dict:
        return {"metrics_history.jsonl": f"history to {step}"}

    def restore_history(self, step: int, checkpoint_dir) -> None:
        self.restored = (step, checkpoint_dir)

    def wait_for_first_scrape(self) -> bool:
        return True

    def close(self, *, failed: bool = False) -> None:
        self.closed, self.failed = True, failed
        self.events.append(("metrics.close",))


class _Stop:
    """A ``StopRequest`` whose ranks agree to stop at ``at`` (the step boundary's count of ``agree`` calls)."""

    def __init__(self, at: int | None = None) -> None:
        self.at, self.calls, self.watched, self.signal_name = at, 0, None, "SIGUSR1"

    def watch(self, signals) -> None:
        self.watched = signals

    def agree(self) -> bool:
        self.calls += 1
        return self.calls == self.at


def _cfg(tmp_path: Path, *overrides: str):
    return load_run_config(REPO / "configs/tiny-cpu.yaml", [
        f"train.output_dir={tmp_path / 'run'}", "train.steps=7", "train.eval_every=3", "train.log_every=2",
        "train.checkpoint_every=4", "train.max_nonfinite_steps=2", "metrics.prometheus=false", *overrides])


class _Job:
    """One ``trainer._train`` call on rank ``rank`` of 2, every component a recorder."""

    def __init__(self, monkeypatch, tmp_path: Path, *overrides: str, rank: int = 0, **session_kw) -> None:
        self.cfg = _cfg(tmp_path, *overrides)
        self.clock, self.events = _Clock(), []
        self.data = _Data(self.clock, self.events)
        self.session = _Session(self.cfg, self.clock, self.events, **session_kw)
        self.metrics: _Metrics | None = None
        self.rank = rank

        def build_metrics(cfg, **kwargs):
            self.metrics = _Metrics(self.events, **kwargs)
            return self.metrics

        def synchronize():
            self.clock.now += DEVICE_TAIL  # the step's queued kernels finishing
            self.events.append(("synchronize", self.session.steps))

        info = DistInfo(rank=rank, world_size=2, local_rank=rank, source="env")
        monkeypatch.setattr(trainer, "check_pretrainable", lambda cfg: None)
        monkeypatch.setattr(trainer, "init_distributed", lambda timeout: info)
        monkeypatch.setattr(trainer, "_setup_logging", lambda info: None)
        monkeypatch.setattr(trainer, "check_world_size", lambda cfg, world_size: None)
        monkeypatch.setattr(trainer, "build_run_data", lambda cfg, info, tokenizer_dir: self.data)
        monkeypatch.setattr(trainer, "TrainSession", SimpleNamespace(create=lambda cfg, f, world_size: self.session))
        monkeypatch.setattr(trainer, "build_metrics", build_metrics)
        monkeypatch.setattr(trainer, "get_accelerator",
                            lambda: SimpleNamespace(synchronize=synchronize, max_memory_allocated=lambda: 0))
        monkeypatch.setattr(trainer, "tdist", SimpleNamespace(
            barrier=lambda: self.events.append(("barrier",)), is_initialized=lambda: False))
        monkeypatch.setattr(trainer.time, "perf_counter", self.clock)
        monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)

    def run(self, resume: str = "none", stop: _Stop | None = None) -> int:
        self.stop = stop or _Stop()
        return trainer._train(self.cfg, resume, self.stop)

    def lines(self, caplog) -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "comera_dist.engine.trainer"]


@pytest.fixture
def job(monkeypatch, tmp_path):
    return lambda *overrides, **kw: _Job(monkeypatch, tmp_path, *overrides, **kw)


def test_a_run_evaluates_logs_and_checkpoints_on_its_schedules_and_at_its_last_step(job, caplog):
    caplog.set_level(logging.INFO, logger="comera_dist.engine.trainer")
    j = job()
    assert j.run() == trainer.EXIT_OK
    assert j.session.steps == 7 and [b[0]["position"] for b in j.session.batches] == [1, 2, 3, 4, 5, 6, 7]
    m = j.metrics
    assert sorted(m.logged) == [0, 1, 2, 3, 4, 5, 6, 7]
    # evaluation: step 0 (the curve's start), every 3 steps, and the last one
    assert [s for s, v in m.logged.items() if "val_loss" in v] == [0, 3, 6, 7]
    assert [e[1] for e in j.events if e[0] == "evaluate"] == [0, 3, 6, 7]
    assert m.logged[3]["val_loss"] == 0.75 and m.logged[3]["val_accuracy"] == 0.5
    # the slower values and the ranks: at the start and every log_every (2) steps
    assert [s for s, v in m.logged.items() if "compression_ratio" in v] == [0, 2, 4, 6]
    assert m.ranks_at == [2, 4, 6]
    assert m.logged[4]["compression_ratio"] == 3.0 and m.logged[4]["model_params"] == 15.0
    assert m.logged[4]["epoch"] == 2.0
    # checkpoints every 4 steps and at the last step, each on the schedule
    assert [s["step"] for s in j.session.saves] == [4, 7] and m.saved == [(True, 4), (True, 7)]
    for save in j.session.saves:
        step = save["step"]
        assert save["retain"] is True
        assert save["client"] == {"step": step, "data_state": {"position": step}, "nonfinite_steps_total": 0,
                                  "reason": "schedule", "tokenizer_sha256": DIGEST}
        assert save["meta_fields"] == {"tokenizer_sha256": DIGEST}
        assert save["side_files"] == {"metrics_history.jsonl": f"history to {step}"}
        assert ("report", step) in j.events[:j.events.index(("save", step))]  # the liveness check comes first
    # the step's values, as the session reported them
    assert m.logged[5]["train_loss"] == 5.0 and m.logged[5]["objective"] == 10.0
    assert m.logged[5]["rank_penalty"] == 0.25 and m.logged[5]["grad_norm"] == 1.5
    assert m.logged[5]["learning_rate"] == 1e-3 and m.logged[5]["stage"] == 0.0
    assert m.logged[5]["nonfinite_steps_total"] == 0.0
    assert m.kwargs["rank"] == 0 and m.kwargs["total_steps"] == 7 and m.kwargs["nonfinite_steps_total"] == 0
    assert m.restored is None  # a fresh start has no history to restore
    # rank 0 says step 0, each log_every step and each evaluation; it saves the run's tokenizer
    steps = [line.split()[1] for line in j.lines(caplog) if line.startswith("step ")]
    assert steps == ["0/7", "2/7", "3/7", "4/7", "6/7", "7/7"], steps
    assert j.data.saved_tokenizer == [Path(j.cfg.train.output_dir) / "tokenizer"]
    # everything is closed, and the ranks leave together before the session goes
    assert m.closed and not m.failed and j.data.train.closed and j.session.closed  # a finished run withdraws
    assert j.events[-3:] == [("metrics.close",), ("barrier",), ("close",)]
    assert j.stop.watched == trainer.STOP_SIGNALS and j.stop.calls == 7


def test_the_step_time_ends_when_the_device_has_finished_the_step(job):
    j = job()
    assert j.run() == trainer.EXIT_OK
    for step in range(1, 8):
        v = j.metrics.logged[step]
        assert v["data_wait_seconds"] == pytest.approx(DATA_WAIT)
        assert v["step_time_seconds"] == pytest.approx(DATA_WAIT + STEP_COMPUTE + DEVICE_TAIL)
        assert v["tokens_per_second"] == pytest.approx(700 / (DATA_WAIT + STEP_COMPUTE + DEVICE_TAIL))
    assert [e[1] for e in j.events if e[0] == "synchronize"] == [1, 2, 3, 4, 5, 6, 7]


def test_other_ranks_say_no_step_lines_and_leave_the_tokenizer_to_rank_0(job, caplog):
    caplog.set_level(logging.INFO, logger="comera_dist.engine.trainer")
    j = job("deepspeed.scheduler.kind=warmup_decay", "deepspeed.scheduler.warmup_steps=50", rank=1, skip={2})
    assert j.run() == trainer.EXIT_OK
    assert j.metrics.kwargs["rank"] == 1 and j.metrics.kwargs["local_rank"] == 1
    assert [s["step"] for s in j.session.saves] == [4, 7]  # every rank saves: a collective
    assert j.data.saved_tokenizer == []
    lines = j.lines(caplog)
    assert not [line for line in lines if line.startswith("step ")], lines
    assert not [line for line in lines if "warmup_steps" in line], lines  # run warnings: rank 0's


def test_rank_0_warns_of_a_run_setting_and_of_each_skipped_step(job, caplog):
    caplog.set_level(logging.INFO, logger="comera_dist.engine.trainer")
    j = job("deepspeed.scheduler.kind=warmup_decay", "deepspeed.scheduler.warmup_steps=50", skip={2, 5})
    assert j.run() == trainer.EXIT_OK
    lines = j.lines(caplog)
    assert any(line.startswith("deepspeed.scheduler.warmup_steps=50 exceeds train.steps=7") for line in lines)
    assert "step 2: non-finite loss or gradients, step skipped (1 in a row, 1 in total)" in lines
    assert "step 5: non-finite loss or gradients, step skipped (1 in a row, 2 in total)" in lines
    assert j.metrics.logged[7]["nonfinite_steps_total"] == 2.0
    assert j.session.saves[-1]["client"]["nonfinite_steps_total"] == 2


def test_consecutive_nonfinite_steps_stop_the_run_with_exit_3_and_an_unretained_checkpoint(job, caplog):
    caplog.set_level(logging.INFO, logger="comera_dist.engine.trainer")
    j = job(skip={1, 3, 4, 5})
    assert j.run() == trainer.EXIT_NONFINITE
    assert j.session.steps == 4  # steps 3 and 4 in a row trip train.max_nonfinite_steps=2
    [save] = j.session.saves
    assert save["step"] == 4 and save["retain"] is False
    assert save["client"]["reason"] == "nonfinite" and save["client"]["nonfinite_steps_total"] == 3
    assert j.metrics.saved == [(True, 4)] and sorted(j.metrics.logged) == [0, 1, 2, 3, 4]
    lines = j.lines(caplog)
    assert any(line.startswith("stopping: 2 consecutive non-finite steps") for line in lines), lines
    assert any(line.startswith("non-finite stop: wrote ") for line in lines), lines
    assert j.events[-2:] == [("barrier",), ("close",)] and j.metrics.closed and j.metrics.failed


def test_nonfinite_gradients_applied_stop_with_exit_3_and_no_checkpoint(job, caplog):
    caplog.set_level(logging.INFO, logger="comera_dist.engine.trainer")
    j = job(raise_at={3: NonFiniteGradientsApplied("step 3: the gradients were not finite")})
    assert j.run() == trainer.EXIT_NONFINITE
    assert j.session.saves == [] and sorted(j.metrics.logged) == [0, 1, 2]
    assert any(line.startswith("stopping without a checkpoint: step 3: the gradients were not finite")
               for line in j.lines(caplog))
    assert j.events[-2:] == [("barrier",), ("close",)] and j.metrics.failed


def test_a_crash_in_a_step_closes_the_metrics_as_failed_and_propagates(job):
    """Not withdrawn like a finished run: the exporter's target stays, down, for Prometheus to alert on."""
    j = job(raise_at={2: RuntimeError("CUDA error: an illegal memory access was encountered")})
    with pytest.raises(RuntimeError, match="illegal memory access"):
        j.run()
    assert j.metrics.closed and j.metrics.failed


def test_a_collapse_stops_the_run_with_exit_4_and_no_checkpoint(job, caplog):
    caplog.set_level(logging.INFO, logger="comera_dist.engine.trainer")
    j = job(size=0)  # S = 0: every rank is dead, read at the start
    assert j.run() == trainer.EXIT_COLLAPSED
    assert j.session.steps == 0 and j.session.saves == []
    assert any(line.startswith("step 0: stopping without a checkpoint: every rank of every TT layer is dead")
               for line in j.lines(caplog)), j.lines(caplog)
    assert j.metrics.closed and j.metrics.failed and j.events[-2:] == [("barrier",), ("close",)]


def test_a_stop_request_checkpoints_at_the_step_boundary_and_exits_0(job, caplog):
    caplog.set_level(logging.INFO, logger="comera_dist.engine.trainer")
    j = job()
    assert j.run(stop=_Stop(at=2)) == trainer.EXIT_OK
    assert j.session.steps == 2
    [save] = j.session.saves
    assert save["step"] == 2 and save["retain"] is True and save["client"]["reason"] == "signal"
    assert "stop requested (SIGUSR1): checkpointing at step 2" in j.lines(caplog)
    assert sorted(j.metrics.logged) == [0, 1, 2]
    assert j.metrics.closed and not j.metrics.failed  # stopped to be requeued: not a failure


def test_a_stop_at_a_scheduled_checkpoint_saves_once(job):
    j = job()
    assert j.run(stop=_Stop(at=4)) == trainer.EXIT_OK
    assert [(s["step"], s["client"]["reason"]) for s in j.session.saves] == [(4, "signal")]


def test_a_resume_continues_after_its_step_with_the_runs_history_and_counts(job, caplog):
    caplog.set_level(logging.INFO, logger="comera_dist.engine.trainer")
    ckpt = "/ckpt/step00000003"
    client = {"step": 3, "data_state": {"position": 3}, "nonfinite_steps_total": 2, "tokenizer_sha256": DIGEST,
              "checkpoint_dir": ckpt}
    j = job(client=client)
    assert j.run("auto") == trainer.EXIT_OK
    assert ("resume", "auto") in j.events
    assert j.session.steps == 4 and [b[0]["position"] for b in j.session.batches] == [4, 5, 6, 7]
    assert sorted(j.metrics.logged) == [3, 4, 5, 6, 7]
    assert "val_loss" not in j.metrics.logged[3]  # no new start of the validation curve
    assert j.metrics.restored == (3, Path(ckpt))
    assert j.metrics.kwargs["nonfinite_steps_total"] == 2
    assert j.session.saves[-1]["client"]["nonfinite_steps_total"] == 2
    assert "resumed at step 3" in j.lines(caplog)
    assert not any(line.startswith("step 0/") for line in j.lines(caplog))
    # the time left, at the mean time of the steps this job took (3 of 3.5 s each at step 6, one to go)
    [at6] = [line for line in j.lines(caplog) if line.startswith("step 6/7 ")]
    assert at6.endswith(" eta 0:00:04"), at6


def test_a_resume_with_another_tokenizer_is_refused(job):
    client = {"step": 3, "data_state": {"position": 3}, "tokenizer_sha256": "cd" * 32, "checkpoint_dir": "/c"}
    j = job(client=client)
    with pytest.raises(InputError, match=r"another tokenizer \(sha256 cdcdcdcdcdcd\) than the one this run "
                                         r"prepared \(sha256 abababababab\)"):
        j.run("auto")
    assert j.session.steps == 0


@pytest.mark.parametrize("rank", [0, 1])
def test_a_resume_at_or_past_the_last_step_trains_nothing_writes_nothing_and_exits_0(job, caplog, rank):
    caplog.set_level(logging.INFO, logger="comera_dist.engine.trainer")
    client = {"step": 7, "data_state": {"position": 7}, "tokenizer_sha256": DIGEST, "checkpoint_dir": "/ckpt/s7"}
    j = job(client=client, rank=rank)
    assert j.run("auto") == trainer.EXIT_OK
    assert j.session.steps == 0 and j.session.saves == [] and j.metrics is None and j.data.saved_tokenizer == []
    assert j.data.train.closed and j.events[-2:] == [("barrier",), ("close",)]
    said = [line for line in j.lines(caplog) if line.startswith("nothing to train")]
    want = ("nothing to train: /ckpt/s7 is at step 7 and train.steps=7; raise train.steps (--set train.steps=N) "
            "to train on")
    assert said == ([want] if rank == 0 else [])


def test_a_prune_reads_the_ranks_and_the_slower_values_at_its_step(job):
    j = job(prune_at={3})
    assert j.run() == trainer.EXIT_OK
    assert j.metrics.ranks_at == [2, 3, 4, 6]
    assert "compression_ratio" in j.metrics.logged[3]
    assert math.isfinite(j.metrics.logged[3]["train_loss"])


def test_a_nonfinite_stop_of_a_nonfinite_state_writes_nothing_and_says_so(job, caplog):
    caplog.set_level(logging.INFO, logger="comera_dist.engine.trainer")
    j = job(skip={1, 2}, state_finite=False)
    assert j.run() == trainer.EXIT_NONFINITE
    assert j.metrics.saved == [(False, 2)]  # the save refused: counted as a failed checkpoint
    assert any(line.startswith("non-finite stop: state non-finite, nothing written") for line in j.lines(caplog))


def test_a_resume_from_a_checkpoint_without_a_tokenizer_digest_goes_on(job):
    """Checkpoints from before the digest was recorded hold none: nothing to compare, the run resumes."""
    j = job(client={"step": 5, "data_state": {"position": 5}, "checkpoint_dir": "/ckpt/s5"})
    assert j.run("auto") == trainer.EXIT_OK
    assert [b[0]["position"] for b in j.session.batches] == [6, 7]


def test_ranks_that_read_dead_because_the_gates_are_not_finite_are_no_collapse(job, caplog):
    """S = 0 from NaN gates: that state is the non-finite guard's to stop, not exit 4 (a collapse's message points
    at the rank penalty's settings); the loop goes on and says why the ranks read dead."""
    caplog.set_level(logging.INFO, logger="comera_dist.engine.trainer")
    j = job(size=0, gates_finite=False)
    assert j.run() == trainer.EXIT_OK
    assert j.session.steps == 7 and [s["step"] for s in j.session.saves] == [4, 7]
    assert any(line.startswith("ranks read dead because rank gates are not finite") for line in j.lines(caplog))


def test_a_compiled_run_compiles_again_after_each_prune(job, monkeypatch):
    """A prune rebuilds the engine around a new module: ``train.compile`` traces it again."""
    monkeypatch.setattr(trainer.torch.compiler, "reset", lambda: None)
    j = job("train.compile=true", prune_at={3, 6})
    assert j.run() == trainer.EXIT_OK
    assert j.session.engine.compiled == 3  # at the start, after the prune at 3 and after the one at 6
