"""Graceful stop on SIGUSR1/SIGTERM: a flag the training loop checks at step boundaries.

Slurm's ``--signal=B:USR1@N`` (forwarded by ``slurm/pretrain.sh``) and launchers tearing
a job down send these signals. The handler only records the request; the loop then
agrees on it across ranks (``agree``), checkpoints and exits 0 so a requeued job resumes.
Importing this module imports no torch, so an entry point can watch before its seconds of imports.

The watched signals are also blocked in the thread that watches them (the main thread), and received by a
thread of this module that leaves them unblocked: CPython runs the handler in the main thread whichever thread
the kernel picked. Slurm signals every process of a step, and a child the trainer starts (Triton's ``ptxas``,
inductor's compile workers, a DeepSpeed op build) would die of the default action in the middle of its work;
a blocked mask is inherited through fork and exec, so those children never see the stop signals, and they
exit with the trainer. ``close`` unblocks them again.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

STOP_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGUSR1, signal.SIGTERM)
START_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGUSR1,)
"""Recorded from the start of a job: Slurm's warning that the time limit is near. Without a handler it
kills the rank (Python's default) or is lost (a launcher's inherited ignore) while the job starts up,
and a job that never checkpoints and exits 0 is not requeued. SIGTERM kills a rank that is still
starting (nothing to save yet, and a launcher tearing a failed job down should not wait on it)."""


class StopRequest:
    """Records the first stop signal received; restores the previous handlers on ``close``."""

    def __init__(self, signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> None:
        self.signal_name: str | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._blocked: set[signal.Signals] = set()  # by watch, not before it: close unblocks only these
        self.watch(signals)

    def watch(self, signals: tuple[signal.Signals, ...]) -> None:
        """Record these signals too (a signal already watched keeps its first previous handler), and block them
        in this thread, and so in every child process and thread started from it from now on."""
        new = [s for s in signals if s not in self._previous]
        for s in new:
            self._previous[s] = signal.signal(s, self._handle)
        if new:
            _receiver.start()  # before the block: its thread inherits this thread's mask
            self._blocked |= set(new) - signal.pthread_sigmask(signal.SIG_BLOCK, new)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        """True once a stop signal has arrived in this process."""
        return self.signal_name is not None

    def agree(self) -> bool:
        """True on every rank if any rank received a stop signal (one tiny all-reduce)."""
        import torch.distributed as dist  # here, not at the top: `comera pretrain` watches before importing torch

        from comera_dist.engine.device import collective_tensor

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return self.requested
        flag = collective_tensor([1.0 if self.requested else 0.0])  # (1,) on the accelerator (NCCL)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def close(self) -> None:
        """Put back the handlers that were installed before, and unblock what ``watch`` blocked."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if self._blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, self._blocked)
        self._blocked = set()
        self._previous = {}


class _Receiver:
    """The one thread that leaves the stop signals unblocked, for the kernel to deliver them to (daemon, idle)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="comera-stop-signals", daemon=True)
                self._thread.start()

    @staticmethod
    def _run() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # even where the parent started us with them blocked
        threading.Event().wait()


_receiver = _Receiver()
