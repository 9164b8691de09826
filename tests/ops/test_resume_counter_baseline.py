"""A resumed job's non-finite step counter counts that job's new non-finite steps only, from the first scrape on.

The checkpoint restores ``nonfinite_steps_total = N``. The exporter first served 0 until the first logged step
set it to N, and ``increase(comera_nonfinite_steps_total[5m]) > 0`` (ComeraLossNaN) fired on that jump after
every resume of a run that ever skipped a step. Then it started at N: a job that skipped steps after its last
checkpoint and was requeued onto the same ``host:port`` served N after a larger value, which ``increase()``
reads as a reset followed by N new steps, and the alert fired again with no new non-finite step. The promtool
cases (``monitoring/rules/comera.rules.test.yml``, "a restart on the same target ...") replay both series.
"""

from __future__ import annotations

import math
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from comera_dist.metrics import Metrics, MetricsConfig, build_metrics

COUNTER = "comera_nonfinite_steps_total"


def _counter(m: Metrics) -> float:
    """The live endpoint's ``comera_nonfinite_steps_total``."""
    text = urllib.request.urlopen(f"http://{m.endpoint}/metrics", timeout=5).read().decode()
    (value,) = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == COUNTER]
    return value


def _resumed(tmp_path, total: float) -> Metrics:
    return build_metrics(MetricsConfig(progress=False, report=False), rank=0, local_rank=0, world_size=1,
                         total_steps=100, output_dir=tmp_path, run_name="resumed", nonfinite_steps_total=total)


def test_a_resumed_job_counts_only_its_own_new_nonfinite_steps(tmp_path):
    m = _resumed(tmp_path, 3)
    try:
        assert _counter(m) == 0  # before anything is logged: the first scrape Prometheus can take
        m.log({"compression_ratio": 2.0}, step=50)  # the trainer's starting values at the resumed step
        assert _counter(m) == 0
        m.log({"train_loss": 4.2, "nonfinite_steps_total": 3.0}, step=51)  # a finite step: the total as restored
        assert _counter(m) == 0
        m.log({"train_loss": math.nan, "nonfinite_steps_total": 4.0}, step=52)  # a new skip counts
        assert _counter(m) == 1
        m.log({"train_loss": math.nan, "nonfinite_steps_total": 6.0}, step=53)  # the trainer's total went by 2
        assert _counter(m) == 3
    finally:
        m.close()


def test_a_fresh_run_starts_at_zero(tmp_path):
    m = build_metrics(MetricsConfig(progress=False, report=False), rank=0, local_rank=0, world_size=1,
                      total_steps=10, output_dir=tmp_path, run_name="fresh")
    try:
        assert _counter(m) == 0
    finally:
        m.close()


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, True, "3"])
def test_a_bad_restored_total_names_the_value(tmp_path, bad):
    with pytest.raises(ValueError, match=r"nonfinite_steps_total must be a finite number >= 0 \(the restored total\)"):
        Metrics(MetricsConfig(prometheus=False, progress=False, report=False), rank=0, local_rank=0, world_size=1,
                total_steps=1, output_dir=tmp_path, run_name="x", nonfinite_steps_total=bad)


@pytest.mark.slow
def test_a_resumed_comera_pretrain_counts_none_of_its_restored_steps(tmp_path):
    """The trainer hands the restored total to the exporter (a real ``comera pretrain`` with 2 skipped steps,
    resumed): every scrape of the resumed job, from the first (which the run waits for before its first step,
    ``metrics.first_scrape_timeout_s``) to the last (``final_scrape_timeout_s``, after step 6), reads 0."""
    import os
    import subprocess
    import sys
    import time
    from pathlib import Path

    from comera_dist.engine.ports import free_port

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_DATASETS_OFFLINE="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", COMERA_CACHE=str(tmp_path / "cache"))
    run = ["pretrain", "--config", "configs/tiny-cpu.yaml", "--set", f"train.output_dir={tmp_path / 'run'}",
           "--set", "comera.pruning.every=0", "--set", "train.checkpoint_every=4"]
    first = subprocess.run([sys.executable, "-m", "comera_dist.cli", *run, "--set", "train.steps=4",
                            "--set", "metrics.prometheus=false"], check=False, cwd=repo, capture_output=True,
                           text=True,
                           env={**env, "COMERA_FAULT_NONFINITE_STEPS": "2,3"}, timeout=300)
    assert first.returncode == 0 and "(2 in a row, 2 in total)" in first.stderr, first.stderr[-3000:]
    port = free_port()
    resumed = subprocess.Popen([sys.executable, "-m", "comera_dist.cli", *run, "--set", "train.steps=6",
                                "--set", "train.log_every=1", "--set", f"metrics.prometheus_port={port}",
                                "--set", "metrics.first_scrape_timeout_s=50",
                                "--set", "metrics.final_scrape_timeout_s=50"],
                               cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    scraped = []  # (the step served, the counter served) of every scrape
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and resumed.poll() is None:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                time.sleep(0.2)
                continue
            samples = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
            scraped.append((samples.get("comera_train_step"), samples[COUNTER]))
            time.sleep(0.2)
    finally:
        log = resumed.communicate(timeout=300)[1]
    assert resumed.returncode == 0 and "resumed at step 4" in log, log[-3000:]
    assert scraped and max(step or 0 for step, _ in scraped) == 6, scraped  # up to the last step's values
    assert {value for _, value in scraped} == {0}, scraped
