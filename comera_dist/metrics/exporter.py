"""PrometheusExporter: the run's metrics on an HTTP endpoint with a dedicated registry.

Naming follows Prometheus conventions: prefix ``comera_``, base units
(``_seconds``, ``_bytes``), counters end in ``_total``, no step label. Gauges are
served by a custom collector so a value appears only once it was logged (a
never-saved checkpoint has no timestamp rather than a misleading 0). The job
advertises the endpoint in a ``file_sd_configs`` JSON file that
``monitoring/prometheus.yml`` watches.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import os
import platform
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, start_http_server, values
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

# logged key -> (metric name, help). Values are exported as they arrive (job-wide on rank 0).
GAUGES: dict[str, tuple[str, str]] = {
    "train_loss": ("comera_train_loss", "Training loss (task loss, cross-entropy) of the last step."),
    "val_loss": ("comera_val_loss", "Validation loss of the last evaluation."),
    "val_accuracy": ("comera_val_accuracy_ratio", "Validation accuracy (0-1) of the last evaluation."),
    "tokens_per_second": ("comera_tokens_per_second", "Training throughput over all ranks, tokens/s."),
    "data_wait_seconds": ("comera_data_wait_seconds",
                          "Part of the last step's time spent waiting for its batch (rank 0), seconds."),
    "learning_rate": ("comera_learning_rate", "Learning rate of the TT cores parameter group."),
    "stage": ("comera_stage", "CoMERA stage: 0 early (weighted sum), 1 late (reference point)."),
    "lambda": ("comera_lambda", "Late-stage switch lambda: 1 when the size objective is further from target."),
    "compression_ratio": ("comera_compression_ratio",
                          "Dense parameter count / current parameter count, whole model."),
    "compression_ratio_tensorized": ("comera_compression_ratio_tensorized",
                                     "Dense / current parameter count of the tensorized layers only."),
    "target_compression_ratio": ("comera_compression_ratio_target",
                                 "Whole-model compression ratio the run aims for."),
    "model_params": ("comera_model_parameters", "Current parameter count of the model (surviving ranks)."),
    "peak_memory_bytes": ("comera_peak_memory_bytes", "Peak accelerator (or host RSS) memory, bytes."),
    "epoch": ("comera_epoch", "Current epoch over the training data."),
}
STEP_TIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 150.0, 300.0, 600.0)


class _GaugeCollector(Collector):
    """Serves the latest value of every logged gauge, and the TT rank gauge with layer/bond labels."""

    def __init__(self, rank_label_limit: int) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, tuple[str, float]] = {}  # metric name -> (help, value)
        self._ranks: dict[tuple[str, str], int] = {}
        self._ranks_dropped = 0
        self._limit = rank_label_limit
        self.last_update = 0.0  # monotonic time of the last set/set_ranks
        self.last_scrape = 0.0  # monotonic time of the last collect() (an HTTP scrape)

    def set(self, name: str, help_text: str, value: float) -> None:
        with self._lock:
            self._values[name] = (help_text, value)
            self.last_update = time.monotonic()

    def set_ranks(self, ranks: Mapping[str, list[int]]) -> None:
        pairs = sorted((layer, str(bond)) for layer, bonds in ranks.items() for bond in range(len(bonds)))
        kept = pairs[: self._limit]
        if len(pairs) > self._limit and self._ranks_dropped == 0:
            log.warning("metrics: %d (layer, bond) rank series exceed rank_label_limit=%d; exporting %d",
                        len(pairs), self._limit, self._limit)
        with self._lock:
            self._ranks = {(layer, bond): ranks[layer][int(bond)] for layer, bond in kept}
            self._ranks_dropped = len(pairs) - len(kept)
            self.last_update = time.monotonic()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        with self._lock:
            values, ranks, dropped = dict(self._values), dict(self._ranks), self._ranks_dropped
            self.last_scrape = time.monotonic()
        for name, (help_text, value) in values.items():
            yield GaugeMetricFamily(name, help_text, value=value)
        if ranks:
            family = GaugeMetricFamily("comera_tt_rank", "Active TT rank of one interior bond of a layer.",
                                       labels=["layer", "bond"])
            for (layer, bond), rank in ranks.items():
                family.add_metric([layer, bond], rank)
            yield family
            yield GaugeMetricFamily("comera_tt_rank_series_dropped",
                                    "Bonds not exported because of rank_label_limit.", value=dropped)


class PrometheusExporter:
    """A dedicated registry, its HTTP server, and the service-discovery file that points at it.

    ``nonfinite_steps_total``: the total a resumed run restored from its checkpoint. The counter counts
    this process's non-finite steps, those beyond that total, like every Prometheus counter a restart
    resets: a restart on the same target reads as a reset (``increase()`` adds nothing), one on a new
    target as a new series. The counter once served the run's total: a resume's first logged step then
    jumped it from 0 to the restored total, and when it started at that total instead, a restart on the
    same target after skips past the checkpoint served less than before, which ``increase()`` read as a
    reset followed by that whole total. Either fired ComeraLossNaN with no new non-finite step. The
    run's total is in the step log lines and the report.
    """

    def __init__(self, *, host: str, port: int, sd_file: Path, run_name: str, world_size: int,
                 total_steps: int, rank_label_limit: int, nonfinite_steps_total: float = 0.0) -> None:
        _process_local_values()
        self.registry = CollectorRegistry(auto_describe=True)
        self._gauges = _GaugeCollector(rank_label_limit)
        self.registry.register(self._gauges)
        self._step_time = Histogram("comera_step_time_seconds", "Wall time of one optimizer step.",
                                    buckets=STEP_TIME_BUCKETS, registry=self.registry)
        self._nonfinite = Counter("comera_nonfinite_steps", "Steps this process skipped for a non-finite loss or "
                                  "gradient (a resumed job starts at 0).", registry=self.registry)
        self._nonfinite_seen = float(nonfinite_steps_total)  # the restored total: steps of earlier jobs
        self._checkpoints = Counter("comera_checkpoint_saves", "Checkpoint save attempts by outcome.",
                                    ["outcome"], registry=self.registry)
        for outcome in ("success", "failure"):
            self._checkpoints.labels(outcome=outcome)  # both series exist from the start, at 0
        Info("comera_build", "Versions of the running program.", registry=self.registry).info(build_info())
        self._gauges.set("comera_world_size", "Processes in the job.", world_size)
        self._gauges.set("comera_train_total_steps", "Steps the run is configured for.", total_steps)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise OSError(f"metrics: cannot serve Prometheus on {host}:{port} "
                          f"(metrics.prometheus_host/prometheus_port): {e}") from e
        self.host, self.port = host, self._server.server_port
        self.sd_file = Path(sd_file)
        self._labels = {"run": run_name}
        if os.environ.get("SLURM_JOB_ID"):
            self._labels["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
        self._write_sd([{"targets": [self.endpoint], "labels": self._labels}])

    @property
    def endpoint(self) -> str:
        """``host:port`` Prometheus should scrape (a wildcard bind advertises this host's name)."""
        host = socket.getfqdn() if self.host in ("0.0.0.0", "::", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{self.port}"

    def update(self, values: Mapping[str, float], step: int) -> None:
        """Export the values of one ``Metrics.log`` call (unknown keys are not exported)."""
        for key, value in values.items():
            if key in GAUGES:
                self._gauges.set(*GAUGES[key], value)
            elif key == "step_time_seconds" and math.isfinite(value) and value >= 0:
                self._step_time.observe(value)
            elif key == "nonfinite_steps_total" and value > self._nonfinite_seen:
                # the trainer logs the run's total; the counter moves by this process's new steps
                self._nonfinite.inc(value - self._nonfinite_seen)
                self._nonfinite_seen = value
        self._gauges.set("comera_train_step", "Last optimizer step logged.", step)
        self._gauges.set("comera_last_step_timestamp_seconds", "Unix time of the last logged step.", time.time())

    def set_gauge(self, key: str, value: float) -> None:
        """Set the gauge of one standard key (see ``GAUGES``) without touching the step gauges."""
        if key not in GAUGES:
            raise KeyError(f"metrics: {key!r} has no gauge; known keys: {sorted(GAUGES)}")
        self._gauges.set(*GAUGES[key], value)

    def update_ranks(self, ranks: Mapping[str, list[int]]) -> None:
        self._gauges.set_ranks(ranks)

    def checkpoint(self, ok: bool, now: float) -> None:
        self._checkpoints.labels(outcome="success" if ok else "failure").inc()
        self._gauges.last_update = time.monotonic()  # a counter moved: the final scrape must see it
        if ok:
            self.set_checkpoint_time(now)

    def set_checkpoint_time(self, when: float) -> None:
        """The last complete checkpoint's Unix time (also a resumed job's, from its history, before it saves)."""
        self._gauges.set("comera_checkpoint_last_success_timestamp_seconds",
                         "Unix time of the last complete checkpoint.", when)

    def wait_for_scrape(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) for a scrape that reads the latest values; return whether one did."""
        deadline = time.monotonic() + timeout_s
        while self._gauges.last_scrape <= self._gauges.last_update and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._gauges.last_scrape > self._gauges.last_update

    def close(self, final_scrape_timeout_s: float = 0.0, *, withdraw: bool = True) -> bool:
        """Stop serving and withdraw the target from the discovery file, if the file still names it.

        With ``final_scrape_timeout_s`` > 0, first wait (at most that long) for a scrape that
        reads the latest values. Returns whether such a scrape happened. ``withdraw=False`` (a failed run)
        leaves the target in the file: Prometheus then finds it down (``up == 0``), which is what
        ``ComeraTrainingStalled`` alerts on. Withdrawn, a crashed run would vanish like a finished one.
        """
        scraped = self.wait_for_scrape(final_scrape_timeout_s)
        if final_scrape_timeout_s > 0 and not scraped:
            log.warning("metrics: no scrape of the final values within %.0f s (metrics.final_scrape_timeout_s)",
                        final_scrape_timeout_s)
        self._server.shutdown()
        self._server.server_close()
        if withdraw:
            self._withdraw()
        return scraped

    def _withdraw(self) -> None:
        """Empty the discovery file unless another job has written its own target there since (two runs given
        one ``metrics.sd_file``): emptying it would leave that live job unscraped."""
        try:
            groups = json.loads(self.sd_file.read_text())
        except (OSError, ValueError):
            groups = None  # gone or damaged: nothing of another job's to keep
        if isinstance(groups, list) and groups and not any(
                isinstance(g, dict) and self.endpoint in g.get("targets", []) for g in groups):
            log.warning("metrics: %s now names another job's target (%s), left in place; give each run its own "
                        "metrics.sd_file", self.sd_file, groups)
            return
        self._write_sd([])

    def _write_sd(self, groups: list[dict]) -> None:
        # atomic replace: Prometheus re-reads the file on change and must never see half of it
        self.sd_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.sd_file.with_name(f".{self.sd_file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(groups, indent=1) + "\n")
        os.replace(tmp, self.sd_file)


def _process_local_values() -> None:
    """Keep every counter and histogram in this process's memory, whatever ``PROMETHEUS_MULTIPROC_DIR`` says.

    prometheus-client reads that variable once, at import, and then keeps every value in an mmapped file of the
    directory named by the process id. Each rank serves its own registry, so that mode only does harm here: a
    missing directory crashed the first metric, and a counter started from an earlier file of the same id (a
    second run in one process, or a recycled pid) instead of 0, so ``increase()`` saw saves and non-finite steps
    that never happened. Process-wide, as the library's own choice is; the variable is left as set, for whatever
    else reads it.
    """
    if values.ValueClass is values.MutexValue:
        return
    log.warning("metrics: PROMETHEUS_MULTIPROC_DIR=%s is ignored: each rank serves its own registry, and "
                "prometheus-client's multiprocess files would carry counts across runs",
                os.environ.get("PROMETHEUS_MULTIPROC_DIR", os.environ.get("prometheus_multiproc_dir")))
    values.ValueClass = values.MutexValue


def build_info() -> dict[str, str]:
    """Versions for ``comera_build_info``; deepspeed's via importlib.metadata (only engine/ imports it)."""
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "absent"
    return {"version": version("comera-dist"), "torch": version("torch"), "deepspeed": version("deepspeed"),
            "python": platform.python_version()}
