"""``metrics.progress.terminal_progress``: a bar on a terminal, nothing in a log file, the items unchanged either
way; the long benchmarks use it."""

from __future__ import annotations

import io
import sys

import pytest

from comera_dist.bench import codebert
from comera_dist.metrics.progress import terminal_progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream", [Terminal(), io.StringIO()], ids=["terminal", "log file"])
def test_a_bar_on_a_terminal_and_none_in_a_log_file(stream, monkeypatch):
    monkeypatch.setattr(sys, "stderr", stream)
    assert list(terminal_progress(range(3), desc="six-encoder", unit="case")) == [0, 1, 2]
    drawn = stream.getvalue()
    if stream.isatty():
        assert "six-encoder:" in drawn and "/3 [" in drawn  # the bar, with its total
    else:
        assert drawn == ""


def test_a_long_benchmark_draws_its_bar_per_contender(monkeypatch, tmp_path):
    stream = Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setenv("COMERA_CACHE", str(tmp_path / "cache"))
    assert codebert.main(["--smoke", "--steps", "2", "--eval-every", "2", "--eval-batches", "1",
                          "--dense-lr", "1e-3", "--dense-lr", "2e-3"]) == 0
    drawn = stream.getvalue()
    for label in ("codebert dense lr=0.001", "codebert dense lr=0.002", "codebert comera"):
        assert f"\r{label}:" in drawn, label
