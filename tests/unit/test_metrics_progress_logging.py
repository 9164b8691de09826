"""Log lines never glue onto the progress bar: while the bar is open they go through ``tqdm.write``."""

from __future__ import annotations

import logging
import re
import sys

from comera_dist.metrics.progress import ProgressBar


def _run(capsys, redirect: bool) -> str:
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    handler = logging.StreamHandler(sys.stderr)  # capsys's stderr, like the trainer's basicConfig handler
    handler.setFormatter(logging.Formatter("LOGLINE %(message)s"))
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    try:
        bar = ProgressBar(total_steps=5, log_every=1, interactive=True)
        if not redirect:
            bar._redirect.__exit__(None, None, None)
            bar._redirect = None
        for step in range(5):
            bar.update({"train_loss": 6.0 - step}, step)
            bar._bar.refresh()  # the bar is on screen when the log line comes
            logging.getLogger("comera_dist.engine.trainer").info("step %d", step)
        bar.close()
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    return capsys.readouterr().err


def test_log_lines_start_on_their_own_line(capsys):
    err = _run(capsys, redirect=True)
    starts = [m.start() for m in re.finditer("LOGLINE", err)]
    assert len(starts) == 5
    for i in starts:  # right after a newline, or after the '\r' that cleared the bar
        assert i == 0 or err[i - 1] in "\n\r", repr(err[max(0, i - 40):i + 10])
    # and the handler is back to the plain one once the bar closed
    assert logging.getLogger().handlers == [] or all(
        type(h).__name__ != "_TqdmLoggingHandler" for h in logging.getLogger().handlers)


def test_without_the_redirect_the_line_glues_onto_the_bar(capsys):
    """The check above is not vacuous: the plain handler writes right after the bar's text."""
    err = _run(capsys, redirect=False)
    glued = [m.start() for m in re.finditer("LOGLINE", err) if m.start() > 0 and err[m.start() - 1] not in "\n\r"]
    assert glued, repr(err[:300])


def test_bar_counts_completed_steps():
    """The trainer logs step 0 (before training) and steps 1..N: the bar ends at N of N, not N+1."""
    bar = ProgressBar(total_steps=8, log_every=1, interactive=True)
    for step in range(9):
        bar.update({"train_loss": 1.0}, step)
    assert (bar._bar.n, bar._bar.total) == (8, 8)
    bar.close()


def test_in_a_log_file_no_bar_is_drawn_and_the_handlers_stay(capsys):
    """stderr not a terminal (pytest's capture, a Slurm output file): nothing but the log lines."""
    before = logging.getLogger().handlers[:]
    bar = ProgressBar(total_steps=4, log_every=1)
    assert not bar.interactive and logging.getLogger().handlers == before
    for step in range(5):
        bar.update({"train_loss": 6.0 - step}, step)
    bar.close()
    assert capsys.readouterr().err == ""


def test_postfix_shows_the_latest_values_with_their_labels():
    bar = ProgressBar(total_steps=10, log_every=1)
    bar.update({"train_loss": 2.34567, "val_loss": 2.75, "tokens_per_second": 12345.6, "compression_ratio": 3.5,
                "compression_ratio_tensorized": 7.0, "stage": 1.0, "learning_rate": 1e-4}, 1)
    bar.update({"train_loss": 2.0}, 2)
    assert bar.postfix() == {"loss": "2", "val": "2.75", "tok/s": "12,346", "cr": "3.5", "stage": "1"}
    assert list(bar.postfix()) == ["loss", "val", "tok/s", "cr", "stage"]  # display order
    bar.close()


def test_postfix_refreshes_every_log_every_steps_and_at_close():
    bar = ProgressBar(total_steps=10, log_every=3)
    shown = []
    for step in range(8):
        bar.update({"train_loss": float(step)}, step)
        shown.append(bar._bar.postfix)
    assert shown == ["loss=0"] * 3 + ["loss=3"] * 3 + ["loss=6"] * 2
    bar.close()
    assert bar._bar.postfix == "loss=7"  # the final line shows the last values, not those of step 6
