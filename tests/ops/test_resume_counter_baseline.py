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
