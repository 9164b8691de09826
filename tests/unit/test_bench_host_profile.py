"""bench.host_profile.top_functions: the functions that took a step's host time, by their own time."""

from __future__ import annotations

import time

import pytest

from comera_dist.bench.host_profile import _name, top_functions


def _busy(seconds: float) -> int:
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        n += 1
    return n


def _step() -> None:
    time.sleep(0.05)
    _busy(0.03)


def test_rows_rank_functions_by_their_own_time():
    rows = top_functions(_step, n=4)
    assert len(rows) == 4 and [r["self_s"] for r in rows] == sorted((r["self_s"] for r in rows), reverse=True)
    top = rows[0]
    assert top["function"] == "<built-in method time.sleep>" and top["calls"] == 1
    assert top["self_s"] == pytest.approx(0.05, abs=0.03) and 0 < top["share"] <= 1
    busy = next(r for r in rows if r["function"].endswith("(_busy)"))
    assert busy["cum_s"] >= 0.02 and busy["self_s"] < busy["cum_s"]  # its perf_counter calls are their own rows


@pytest.mark.parametrize(("key", "name"), [
    (("/x/.venv/lib/python3.11/site-packages/deepspeed/runtime/engine.py", 3381, "backward"),
     "deepspeed/runtime/engine.py:3381(backward)"),
    (("/home/u/repo/comera_dist/engine/session.py", 250, "train_step"), "comera_dist/engine/session.py:250(train_step)"),
    (("/home/u/elsewhere/script.py", 3, "f"), "/home/u/elsewhere/script.py:3(f)"),
    (("~", 0, "<built-in method torch.bmm>"), "<built-in method torch.bmm>"),
])
def test_functions_are_named_from_their_package(key, name):
    assert _name(key) == name
