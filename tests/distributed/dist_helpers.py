"""``run_ranks``: run a function in N real processes (DeepSpeed on gloo, loopback, own port) and collect results.

The DistributedTest-style helper of the distributed tests. Each rank is a fresh ``spawn``
process with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` set, so
``engine.distributed.init_distributed`` takes the launcher path. The function runs as
``fn(rank, world_size, *args)``; whatever it returns is pickled to ``<workdir>/result-<rank>.pkl``
and handed back, one entry per rank. A rank that exits non-zero, raises, or outlives the
timeout fails the test with its exit code, except where ``expect_exit`` allows it (tests that
kill themselves).
"""

from __future__ import annotations

import faulthandler
import logging
import multiprocessing as mp
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from comera_dist.engine.ports import free_port


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, workdir: str, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    # A native abort (SIGABRT, SIGSEGV) leaves no Python traceback of its own: this one names the line.
    faults = open(Path(workdir) / f"fault-{rank}.txt", "w")  # noqa: SIM115 (open until the process ends)
    faulthandler.enable(file=faults, all_threads=True)
    import torch

    torch.set_num_threads(1)
    out = Path(workdir) / f"result-{rank}.pkl"
    try:
        result = fn(rank, world_size, *args)
    except BaseException:
        (Path(workdir) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise
    with open(out, "wb") as f:
        pickle.dump(result, f)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    # The result is on disk and the group is gone; what is left is interpreter teardown. CI twice saw a
    # rank abort with -6, "terminate called without an active exception" (a native thread destroyed
    # while joinable): on b25e13f after the rank had written its result (test_checkpoint_integrity's
    # resume), on 3c9c812 in test_device_discipline, where the log cannot tell whether before or after.
    # Skip teardown: what a test asserts is what ``fn`` returned. An abort before this point is still
    # a failure, reported with its faulthandler trace (``_exit_detail``).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_detail(workdir: Path, rank: int) -> str:
    """What a failed rank left behind: its Python traceback, else where a native fault hit."""
    err = workdir / f"error-{rank}.txt"
    if err.exists():
        return err.read_text()
    done = "after" if (workdir / f"result-{rank}.pkl").exists() else "before"
    fault = workdir / f"fault-{rank}.txt"
    trace = fault.read_text() if fault.exists() else ""
    return f"(no Python exception; it died {done} writing its result)\n{trace}"


def run_ranks(fn: Callable[..., Any], workdir: Path, *args: Any, world_size: int = 2, timeout: float = 240.0,
              expect_exit: dict[int, int | None] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks; returns each rank's result.

    ``expect_exit`` maps rank -> accepted exit code (e.g. ``-signal.SIGKILL``; None: any non-zero
    code); such ranks return None.
    """
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    for pattern in ("result-*.pkl", "error-*.txt", "fault-*.txt"):
        for stale in workdir.glob(pattern):
            stale.unlink()
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, str(workdir), args), daemon=False)
             for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        os.kill(procs[r].pid, signal.SIGKILL)
        procs[r].join()
    expect_exit = expect_exit or {}
    errors = []
    for r, p in enumerate(procs):
        if r in hung:
            errors.append(f"rank {r} still running after {timeout} s (killed)")
        elif r in expect_exit and expect_exit[r] is None and p.exitcode != 0:
            continue
        elif p.exitcode != expect_exit.get(r, 0):
            detail = _exit_detail(workdir, r)
            errors.append(f"rank {r} exited with {p.exitcode} (expected {expect_exit.get(r, 0)})\n{detail}")
    if errors:
        raise AssertionError("\n".join(errors))
    results = []
    for r in range(world_size):
        path = workdir / f"result-{r}.pkl"
        if path.exists():
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        else:
            results.append(None)
    return results


class LogLines(logging.Handler):
    """Collects the messages of the records at ``level`` or above (attach it to a logger in a rank)."""

    def __init__(self, level: int = logging.INFO) -> None:
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
