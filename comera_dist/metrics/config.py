"""MetricsConfig: what the metrics fan-out (progress bar, Prometheus exporter, report) does."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    """The ``metrics:`` section of a run config."""

    prometheus: bool = True
    """Serve a Prometheus endpoint from global rank 0 (one exporting process per job)."""

    prometheus_host: str = "127.0.0.1"
    """Address the exporter binds to; loopback by default so nothing is exposed unless asked for."""

    prometheus_port: int = 0
    """TCP port of the exporter; 0 picks a free port (the job publishes it through ``sd_file``)."""

    sd_file: str | None = None
    """File-based service discovery JSON the job writes for ``monitoring/prometheus.yml``
    (``file_sd_configs``); None means ``<output_dir>/prometheus_targets.json``."""

    final_scrape_timeout_s: float = 0.0
    """At ``close``, keep serving until a scrape has read the final values, for at most this many
    seconds (0: stop at once). Short jobs need it: Prometheus hands file_sd changes to its scrapers
    only every 5 s, so a run of a few seconds can end before its first scrape."""

    first_scrape_timeout_s: float = 0.0
    """Before the first training step, wait until a scrape has read the starting values, for at most
    this many seconds (0: start at once; only rank 0 waits, the others meet it at the first step's
    collective). With ``final_scrape_timeout_s`` it gives a run of a few seconds a sample before and
    after its steps, so ``rate()`` panels (step time, throughput) have data for it. Both waits must be
    below ``train.process_group_timeout_s`` (checked with the run config)."""

    progress: bool = True
    """Show a tqdm progress bar (loss, tokens/s, compression ratio, stage) on rank 0, when its stderr is a
    terminal (in a log file the trainer's step lines, with their ETA, are the progress record)."""

    log_every: int = 10
    """Refresh the progress-bar postfix every this many steps (Prometheus always gets every value)."""

    report: bool = True
    """Write ``<output_dir>/report.md`` and its PNG plots when the run closes (rank 0)."""

    rank_label_limit: int = 64
    """Most ``(layer, bond)`` label pairs the ``comera_tt_rank`` gauge may carry (bounded cardinality);
    bonds beyond it are dropped from the exporter (counted in ``comera_tt_rank_series_dropped``) but
    still reach the report."""

    compression_target: float | None = None
    """Whole-model compression ratio (dense / current parameters) the run must reach; exported as
    ``comera_compression_ratio_target`` for the "compression target missed" alert. None: no target and no
    alert (the trainer logs no ``target_compression_ratio``; another caller of ``Metrics.log`` may). Not
    ``comera.controller.target_ratio``, the late stage's size target relative to the size at the switch."""

    def __post_init__(self) -> None:
        try:
            ipaddress.ip_address(self.prometheus_host)
        except ValueError:
            if not self.prometheus_host or any(c.isspace() for c in self.prometheus_host):
                raise ValueError(
                    f"metrics.prometheus_host must be an IP address or host name, got {self.prometheus_host!r}"
                ) from None
        if not 0 <= self.prometheus_port <= 65535:
            raise ValueError(f"metrics.prometheus_port must be in [0, 65535], got {self.prometheus_port}")
        if self.sd_file is not None and not self.sd_file.strip():
            raise ValueError(f"metrics.sd_file must be a path or null, got {self.sd_file!r}")
        for key in ("first_scrape_timeout_s", "final_scrape_timeout_s"):
            if not 0 <= getattr(self, key) <= 3600:
                raise ValueError(f"metrics.{key} must be in [0, 3600], got {getattr(self, key)}")
        if self.log_every < 1:
            raise ValueError(f"metrics.log_every must be >= 1, got {self.log_every}")
        if self.compression_target is not None and not self.compression_target > 0:
            raise ValueError(f"metrics.compression_target must be > 0 or null, got {self.compression_target}")
        if self.rank_label_limit < 1:
            raise ValueError(f"metrics.rank_label_limit must be >= 1, got {self.rank_label_limit}")
