"""Inductor's compile workers, started so that the job's stop signals cannot kill them.

Slurm delivers a step signal (``scancel --signal=USR1``, the time-limit warning, a TERM) to every process of
the step, the trainers' children included. Inductor compiles Triton kernels in a worker pool of its own
processes (``SubprocPool``: a sidecar started with ``subprocess.Popen`` and its process pool), which install
no USR1 handler, so the default action killed them. The trainer carried on towards its checkpoint, and the
next kernel it compiled (a graph after a prune, the first evaluation) waited on the dead pool forever, until
the time limit killed the job without that checkpoint.

A blocked signal stays blocked across ``fork`` and ``exec``: the pool started while the main thread blocks
``signals`` never receives them (they stay pending in its processes, which exit with the trainer). The trainer
itself loses nothing: a signal arriving meanwhile is taken by another thread or delivered once unblocked.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable


def start_compile_workers(signals: Iterable[signal.Signals]) -> bool:
    """Start inductor's compile-worker pool now (what its first Triton kernel would do), with ``signals`` blocked
    in its processes. Returns whether a pool runs: none where inductor compiles in-process (one compile thread,
    no Triton). Call it from the thread that compiles, before the first compile."""
    from torch._inductor import async_compile

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, set(signals))
    try:
        # the sidecar, started here, keeps the mask, and so do the workers it forks, whenever it does
        async_compile.maybe_warm_pool()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return bool(async_compile._pool_set)
