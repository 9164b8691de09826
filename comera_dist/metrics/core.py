"""Metrics: the one metrics interface of a run, fanned out to progress bar, Prometheus and report.

Only global rank 0 does anything. The engine all-reduces every value it logs
(loss, tokens/s, ...) so rank 0 already holds the job-wide numbers; exporting
from one process per job keeps one scrape target, one series per metric and no
duplicate samples. Other ranks get a ``Metrics`` whose methods return at once.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from comera_dist.metrics.config import MetricsConfig
from comera_dist.metrics.exporter import PrometheusExporter
from comera_dist.metrics.history import History
from comera_dist.metrics.progress import ProgressBar
from comera_dist.metrics.report import write_report

log = logging.getLogger(__name__)

HISTORY_FILE = "metrics_history.json"
"""Rank 0's history as of a checkpoint, in the checkpoint's directory: a job resumed from it continues it.
Older versions wrote it beside the report after the checkpoint was published; a resume still reads it there."""

STANDARD_KEYS: tuple[str, ...] = (
    "train_loss", "val_loss", "val_accuracy", "tokens_per_second", "step_time_seconds", "data_wait_seconds",
    "learning_rate", "stage", "lambda", "compression_ratio", "compression_ratio_tensorized", "model_params",
    "peak_memory_bytes", "nonfinite_steps_total", "epoch", "target_compression_ratio",
)
"""Keys with a meaning (and a Prometheus metric); any other key is kept for the report only."""


class Metrics:
    """Fan-out of ``log``/``log_ranks``/``checkpoint_saved`` to the enabled sinks (rank 0 only).

    ``nonfinite_steps_total``: the non-finite step total a resumed run restored; the exported counter
    counts only the steps beyond it (``PrometheusExporter``), so resuming is not mistaken for new ones.
    """

    def __init__(self, cfg: MetricsConfig, *, rank: int, local_rank: int, world_size: int,
                 total_steps: int, output_dir: str | Path, run_name: str, nonfinite_steps_total: float = 0) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"Metrics: rank must be in [0, world_size={world_size}), got rank={rank}")
        if local_rank < 0:
            raise ValueError(f"Metrics: local_rank must be >= 0, got {local_rank}")
        if total_steps < 0:
            raise ValueError(f"Metrics: total_steps must be >= 0, got {total_steps}")
        if not run_name:
            raise ValueError(f"Metrics: run_name must be non-empty, got {run_name!r}")
        if isinstance(nonfinite_steps_total, bool) or not isinstance(nonfinite_steps_total, numbers.Real) \
                or not 0 <= nonfinite_steps_total < math.inf:
            raise ValueError(f"Metrics: nonfinite_steps_total must be a finite number >= 0 (the restored total), "
                             f"got {nonfinite_steps_total!r}")
        self.cfg = cfg
        self.rank, self.local_rank, self.world_size = rank, local_rank, world_size
        self.total_steps = total_steps
        self.output_dir = Path(output_dir)
        self.run_name = run_name
        self.history = History()
        self.exporter: PrometheusExporter | None = None
        self.progress: ProgressBar | None = None
        self._closed = False
        if not self.active:
            return
        if cfg.prometheus:
            sd_file = Path(cfg.sd_file) if cfg.sd_file else self.output_dir / "prometheus_targets.json"
            self.exporter = PrometheusExporter(
                host=cfg.prometheus_host, port=cfg.prometheus_port, sd_file=sd_file, run_name=run_name,
                world_size=world_size, total_steps=total_steps, rank_label_limit=cfg.rank_label_limit,
                nonfinite_steps_total=float(nonfinite_steps_total))
            if cfg.compression_target is not None:
                self.exporter.set_gauge("target_compression_ratio", cfg.compression_target)
            log.info("metrics: Prometheus endpoint http://%s/metrics (targets in %s)",
                     self.exporter.endpoint, sd_file)
        if cfg.progress:
            self.progress = ProgressBar(total_steps=total_steps, log_every=cfg.log_every)

    @property
    def active(self) -> bool:
        """True on the one process that exports and reports (global rank 0)."""
        return self.rank == 0

    @property
    def endpoint(self) -> str | None:
        """``host:port`` of the Prometheus endpoint, or None where none is served."""
        return self.exporter.endpoint if self.exporter else None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        """Record job-wide scalar values (already all-reduced by the caller) at ``step``."""
        _check_step(step)
        values = {}
        for key, value in metrics.items():
            if not isinstance(value, numbers.Real):  # bools count as 0/1 (e.g. stage)
                raise TypeError(f"Metrics.log: value of {key!r} must be a real number, got {value!r}")
            values[str(key)] = float(value)
        if not self.active or self._closed:
            return
        self.history.add_scalars(values, step)
        if self.exporter:
            self.exporter.update(values, step)
        if self.progress:
            self.progress.update(values, step)

    def log_ranks(self, ranks: Mapping[str, Sequence[int]], step: int) -> None:
        """Record the active TT ranks: ``{layer name: [rank of each interior bond]}``."""
        _check_step(step)
        snapshot = {}
        for layer, bonds in ranks.items():
            bonds = list(bonds)
            if any(isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 0 for r in bonds):
                raise ValueError(f"Metrics.log_ranks: ranks of layer {layer!r} must be ints >= 0, got {bonds}")
            snapshot[str(layer)] = [int(r) for r in bonds]
        if not self.active or self._closed:
            return
        self.history.add_ranks(snapshot, step)
        if self.exporter:
            self.exporter.update_ranks(snapshot)

    def checkpoint_saved(self, ok: bool, step: int) -> None:
        """Record a checkpoint attempt (``ok``: published completely) at ``step``."""
        _check_step(step)
        if not self.active or self._closed:
            return
        now = time.time()
        self.history.checkpoints.append((step, bool(ok), now))
        if self.exporter:
            self.exporter.checkpoint(bool(ok), now)

    def history_files(self, step: int) -> dict[str, str]:
        """Rank 0: ``{HISTORY_FILE: text}``, the history as of checkpoint ``step`` for the checkpoint's own
        directory (the manifest covers it, so no crash can separate the two): the job resuming from it reports
        the whole run, not only its own steps. Its checkpoint record is in it, since it is read only from a
        published checkpoint. Other ranks: ``{}``."""
        if not self.active:
            return {}
        state = self.history.state()
        state["checkpoints"] = [*state["checkpoints"], (step, True, time.time())]
        return {HISTORY_FILE: json.dumps({"step": step, "history": state})}

    def restore_history(self, step: int, checkpoint_dir: str | Path) -> None:
        """Rank 0 of a job resumed at checkpoint ``step`` (``checkpoint_dir``): continue the history saved in
        it. A checkpoint written before the history moved into it: the one beside the report, without what was
        logged after ``step`` by a job that resumed from an older checkpoint. None (or a damaged file): the
        report covers this job only, and says so in the log."""
        if not self.active:
            return
        path = Path(checkpoint_dir) / HISTORY_FILE
        if not path.is_file():
            path = self.output_dir / HISTORY_FILE  # the older place, written after the checkpoint
        try:
            saved = json.loads(path.read_text())
            self.history = History.from_state(saved["history"], upto=step)
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("metrics: no history of the steps before %d (%s: %s): the report covers this job's steps "
                        "only", step, path, e)
            return
        if saved["step"] < step:
            log.warning("metrics: the history in %s ends at step %d, the resumed checkpoint is step %d: the report "
                        "misses the steps between", path, saved["step"], step)
        done = [when for _, ok, when in self.history.checkpoints if ok]
        if self.exporter and done:  # the checkpoint-age alert and panel see the resumed one until this job saves
            self.exporter.set_checkpoint_time(max(done))

    def wait_for_first_scrape(self) -> bool:
        """Rank 0: wait up to ``first_scrape_timeout_s`` for a scrape of the values logged so far.

        Returns whether one happened (True where nothing is exported or no wait is configured).
        """
        if not self.exporter or self._closed or self.cfg.first_scrape_timeout_s <= 0:
            return True
        scraped = self.exporter.wait_for_scrape(self.cfg.first_scrape_timeout_s)
        if not scraped:
            log.warning("metrics: no scrape of the starting values within %.0f s (metrics.first_scrape_timeout_s); "
                        "training anyway", self.cfg.first_scrape_timeout_s)
        return scraped

    def close(self, *, failed: bool = False) -> None:
        """Stop the progress bar and exporter; write the report (rank 0). Safe to call twice.

        ``failed`` (a crash, a non-finite or collapsed stop): the exporter's target stays in ``metrics.sd_file``,
        so Prometheus sees the run down and alerts, instead of the run leaving like a finished one.
        """
        if self._closed:
            return
        self._closed = True
        if self.progress:
            self.progress.close()
        if self.exporter:
            self.exporter.close(self.cfg.final_scrape_timeout_s, withdraw=not failed)
            if failed:
                log.warning("metrics: the run failed; its target stays in %s, down, so that Prometheus alerts "
                            "(ComeraTrainingStalled) until a new run of it replaces the target",
                            self.exporter.sd_file)
        if self.active and self.cfg.report:
            path = write_report(self.history, self.output_dir, run_name=self.run_name,
                                world_size=self.world_size, total_steps=self.total_steps)
            log.info("metrics: report written to %s", path)

    def __enter__(self) -> Metrics:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(failed=exc_type is not None)


def _check_step(step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"Metrics: step must be an int >= 0, got {step!r}")
