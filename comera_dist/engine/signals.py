"""Graceful stop on SIGUSR1/SIGTERM: a flag the training loop checks at step boundaries.

Slurm's ``--signal=B:USR1@N`` (forwarded by ``slurm/pretrain.sh``) and launchers tearing
a job down send these signals. The handler only records the request; the loop then
agrees on it across ranks (``agree``), checkpoints and exits 0 so a requeued job resumes.
Importing this module imports no torch, so an entry point can watch before its seconds of imports.
"""

from __future__ import annotations

import signal
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
        self.watch(signals)

    def watch(self, signals: tuple[signal.Signals, ...]) -> None:
        """Record these signals too (a signal already watched keeps its first previous handler)."""
        for s in signals:
            if s not in self._previous:
                self._previous[s] = signal.signal(s, self._handle)

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
        """Put back the handlers that were installed before."""
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
