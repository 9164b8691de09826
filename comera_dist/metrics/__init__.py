"""The metrics interface of a run: ``build_metrics`` -> ``Metrics`` (progress bar, Prometheus, report).

One exporting process per job: global rank 0 (the engine all-reduces what it logs).
"""

from __future__ import annotations

from pathlib import Path

from comera_dist.metrics.config import MetricsConfig
from comera_dist.metrics.core import STANDARD_KEYS, Metrics

__all__ = ["STANDARD_KEYS", "Metrics", "MetricsConfig", "build_metrics"]


def build_metrics(cfg: MetricsConfig, *, rank: int, local_rank: int, world_size: int, total_steps: int,
                  output_dir: str | Path, run_name: str, nonfinite_steps_total: float = 0) -> Metrics:
    """The run's ``Metrics``; active (exporter, bar, report) on global rank 0, a no-op elsewhere.

    A resumed run passes the ``nonfinite_steps_total`` its checkpoint restored: the exported counter
    counts only the non-finite steps beyond it (see ``PrometheusExporter``).
    """
    return Metrics(cfg, rank=rank, local_rank=local_rank, world_size=world_size, total_steps=total_steps,
                   output_dir=output_dir, run_name=run_name, nonfinite_steps_total=nonfinite_steps_total)
