"""A resumed run's non-finite step counter starts at the restored total, from the first scrape on.

The checkpoint restores ``nonfinite_steps_total = N``; the new process's exporter used to serve 0 until
the first logged step set it to N, and ``increase(comera_nonfinite_steps_total[5m]) > 0`` (ComeraLossNaN)
fired on that jump after every resume of a run that ever skipped a step, with no new non-finite step.
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


def test_first_scrape_after_a_resume_reads_the_restored_total(tmp_path):
    m = _resumed(tmp_path, 3)
    try:
        assert _counter(m) == 3  # before anything is logged: the first scrape Prometheus can take
        m.log({"compression_ratio": 2.0}, step=50)  # the trainer's starting values at the resumed step
        assert _counter(m) == 3
        m.log({"train_loss": 4.2, "nonfinite_steps_total": 3.0}, step=51)  # a finite step: the total as restored
        assert _counter(m) == 3
        m.log({"train_loss": math.nan, "nonfinite_steps_total": 4.0}, step=52)  # a new skip still counts
        assert _counter(m) == 4
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
def test_a_resumed_comera_pretrain_is_first_scraped_at_its_restored_total(tmp_path):
    """The trainer hands the restored total to the exporter (a real ``comera pretrain``, resumed): the first
    scrape, which the run waits for before its first step (``metrics.first_scrape_timeout_s``), reads it."""
    import os
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    resumed = subprocess.Popen([sys.executable, "-m", "comera_dist.cli", *run, "--set", "train.steps=6",
                                "--set", f"metrics.prometheus_port={port}", "--set", "metrics.first_scrape_timeout_s=50"],
                               cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, text = time.monotonic() + 120, None
        while text is None and time.monotonic() < deadline and resumed.poll() is None:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                time.sleep(0.2)
        assert text is not None, resumed.stderr.read()[-3000:] if resumed.poll() is not None else "no endpoint"
        (value,) = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == COUNTER]
        assert value == 2
    finally:
        log = resumed.communicate(timeout=300)[1]
    assert resumed.returncode == 0 and "resumed at step 4" in log, log[-3000:]
