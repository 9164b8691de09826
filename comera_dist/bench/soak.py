"""``python -m comera_dist.bench soak``: a long run of the real training job, checkpointing as it goes.

The tiny CPU config (``configs/tiny-cpu.yaml``: pruning, stage switch, evaluation, data loader)
runs through ``engine.trainer.train`` in this process as a 1-rank job for ``--steps`` steps
(default 2,000), checkpointing every ``--checkpoint-every`` steps (default 100) with the
default retention. The bench wraps two session methods, without changing them, to observe
the job: ``train_step`` (the resident set size after every step, from ``/proc/self/statm``)
and ``save`` (wall time of every checkpoint: DeepSpeed's files, the consolidated state, the
manifest digests and the read-back verification).

Metrics: ``rss_drift`` (median RSS of the last quarter of the steps over that of the first
quarter, minus 1; target within +-5%), ``checkpoint_time_share`` (time in ``save`` over the
job's wall time), ``save_seconds_median``, ``digest_seconds_per_checkpoint`` (one sha256 pass
over a published checkpoint, timed after the run; a save makes two: hashing and read-back)
and ``checkpoint_bytes``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from comera_dist.bench.common import base_parser, single_rank_env, write_result

CONFIG = "configs/tiny-cpu.yaml"
_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    """This process's resident set size (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def rss_drift(series: list[int]) -> float:
    """Median of the last quarter over the median of the first quarter, minus 1 (0.03 = 3% growth)."""
    q = max(1, len(series) // 4)
    return statistics.median(series[-q:]) / statistics.median(series[:q]) - 1.0


def _single_rank_env() -> None:
    single_rank_env()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _observe(session_cls, rss: list[int], saves: list[float]) -> None:
    """Record RSS after each step and the wall time of each save (wrappers around the real methods)."""
    step, save = session_cls.train_step, session_cls.save

    def train_step(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        rss.append(rss_bytes())
        return out

    def timed_save(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return save(self, *args, **kwargs)
        finally:
            saves.append(time.perf_counter() - t0)

    session_cls.train_step, session_cls.save = train_step, timed_save


def run(steps: int, every: int, out_dir: Path, overrides: list[str]) -> dict[str, Any]:
    _single_rank_env()
    from comera_dist.config import load_run_config
    from comera_dist.engine import checkpoint as ckpt
    from comera_dist.engine import manifest
    from comera_dist.engine.session import TrainSession
    from comera_dist.engine.trainer import train

    sets = [f"train.steps={steps}", f"train.checkpoint_every={every}", f"train.output_dir={out_dir}",
            "train.log_every=50", f"train.eval_every={every}", "metrics.prometheus=false",
            "metrics.progress=false", "metrics.report=false", *overrides]
    cfg = load_run_config(CONFIG, sets)
    rss: list[int] = []
    saves: list[float] = []
    _observe(TrainSession, rss, saves)
    t0 = time.perf_counter()
    status = train(cfg, resume="none")
    wall = time.perf_counter() - t0
    if status != 0:
        raise SystemExit(f"soak: the job exited with status {status}")
    last = ckpt.latest_complete(out_dir / "checkpoints")
    names = manifest.checkpoint_files(last)
    t1 = time.perf_counter()
    manifest.describe(last, names)
    digest_s = time.perf_counter() - t1
    return {"steps": steps, "checkpoint_every": every, "checkpoints": len(saves), "wall_seconds": wall,
            "rss_drift": rss_drift(rss), "rss_first_quarter_median_bytes": statistics.median(rss[:len(rss) // 4 or 1]),
            "rss_last_quarter_median_bytes": statistics.median(rss[-(len(rss) // 4 or 1):]),
            "checkpoint_time_share": sum(saves) / wall, "save_seconds_median": statistics.median(saves),
            "digest_seconds_per_checkpoint": digest_s,
            "checkpoint_bytes": sum((last / n).stat().st_size for n in names),
            "checkpoints_on_disk": len(ckpt.complete_checkpoints(out_dir / "checkpoints")),
            "rss_every_100_steps_bytes": rss[::100]}


def main(argv: list[str]) -> int:
    p = base_parser("soak", __doc__.splitlines()[0])
    p.add_argument("--checkpoint-every", type=int, default=100, help="steps between checkpoints")
    p.add_argument("--out", type=Path, default=None, help="run directory (default: a temporary one)")
    p.add_argument("--set", action="append", default=[], help="extra config override a.b=value")
    args = p.parse_args(argv)
    steps = 2000 if args.steps is None else args.steps
    if steps < 1:
        p.error(f"--steps must be >= 1, got {steps}")
    if args.batch_size is not None:
        p.error("--batch-size: the batch is the config's; use --set deepspeed.micro_batch_size_per_gpu=B")
    with tempfile.TemporaryDirectory(prefix="comera-soak-") as tmp:
        metrics = run(steps, args.checkpoint_every, args.out or Path(tmp) / "run", args.set)
    series = metrics.pop("rss_every_100_steps_bytes")
    rows = [{"step": 1 + 100 * i, "rss_mib": b / 2**20} for i, b in enumerate(series)]
    config = {"config": CONFIG, "steps": steps, "checkpoint_every": args.checkpoint_every, "world_size": 1,
              "overrides": args.set, "full_run": steps >= 2000}
    write_result(args.json, "soak", metrics, rows, config, argv=argv)
    from comera_dist.engine.distributed import leave_distributed

    leave_distributed()  # as `comera pretrain` leaves: the process group destroyed, not left to exit
    return 0
