"""Progress bars: the trainer's rank-0 bar (``ProgressBar``) and ``terminal_progress`` for other long loops.

``ProgressBar`` shows loss, tokens/s, compression ratio and stage.

While the bar is open, console log records (the root logger's and DeepSpeed's stderr/stdout
handlers) go through ``tqdm.write`` (``tqdm.contrib.logging.logging_redirect_tqdm``): the bar
is cleared, the line printed, the bar redrawn below it, so no log line is glued to the bar.

The bar is drawn only when stderr is a terminal. In a log file (a Slurm job's output, ``> run.log``)
each redraw and each clearing is a ``\r``-joined fragment between the log lines; there the trainer's
own step lines, which carry an ETA, are the progress record.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Mapping
from typing import TypeVar

from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

T = TypeVar("T")

# Loggers with their own console handlers: the root (the trainer's) and DeepSpeed's (propagate=False).
REDIRECTED_LOGGERS = ("", "DeepSpeed")

# logged key -> short postfix label, in display order
POSTFIX = {"train_loss": "loss", "val_loss": "val", "tokens_per_second": "tok/s",
           "compression_ratio": "cr", "stage": "stage"}


class ProgressBar:
    """A step bar whose postfix shows the latest values, refreshed every ``log_every`` steps."""

    def __init__(self, *, total_steps: int, log_every: int, interactive: bool | None = None) -> None:
        """``interactive``: draw the bar (default: whether stderr is a terminal)."""
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self._bar = tqdm(total=total_steps or None, unit="step", dynamic_ncols=True, mininterval=0.1,
                         disable=not self.interactive)
        self._redirect = None
        if self.interactive:
            self._redirect = logging_redirect_tqdm(loggers=[logging.getLogger(n) for n in REDIRECTED_LOGGERS],
                                                   tqdm_class=tqdm)
            self._redirect.__enter__()
        self._log_every = log_every
        self._latest: dict[str, float] = {}
        self._last_postfix_step: int | None = None

    def update(self, values: Mapping[str, float], step: int) -> None:
        self._latest.update({k: v for k, v in values.items() if k in POSTFIX})
        done = step  # steps completed (the trainer logs step 0 before the first); a resumed run starts there
        if done > self._bar.n:
            self._bar.update(done - self._bar.n)
        if self._last_postfix_step is None or step - self._last_postfix_step >= self._log_every:
            self._last_postfix_step = step
            self._bar.set_postfix(self.postfix(), refresh=True)

    def postfix(self) -> dict[str, str]:
        out = {}
        for key, label in POSTFIX.items():
            if key in self._latest:
                value = self._latest[key]
                out[label] = (f"{value:.0f}" if key == "stage" else f"{value:.3g}" if key != "tokens_per_second"
                              else f"{value:,.0f}")
        return out

    def close(self) -> None:
        self._bar.set_postfix(self.postfix(), refresh=False)
        self._bar.close()
        if self._redirect is not None:  # the original console handlers come back
            self._redirect.__exit__(None, None, None)
            self._redirect = None


def terminal_progress(items: Iterable[T], *, desc: str, total: int | None = None, unit: str = "it") -> Iterable[T]:
    """``items`` with a tqdm bar on stderr while a long loop (a benchmark, ``comera evaluate``) works through them.

    Drawn only when stderr is a terminal: a bar redrawn into a log file (CI, Slurm, ``> out.txt``) is
    noise there. The bar closes when the loop ends.
    """
    return tqdm(items, desc=desc, total=total, unit=unit, disable=None, leave=False, dynamic_ncols=True)
