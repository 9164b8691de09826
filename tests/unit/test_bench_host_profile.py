"""bench.host_profile.host_profile: the functions that took a step's host time, by own and cumulative time."""

from __future__ import annotations

import cProfile
import time

import pytest

from comera_dist.bench.host_profile import _name, host_profile, profile_rows


class _Clock:
    """The profiler's clock in these tests: it moves only where a function below spends "time", so every
    figure is exact (a wall clock on a loaded machine is not)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


CLOCK = _Clock()


def _wait() -> None:
    CLOCK.now += 0.05


def _busy(seconds: float) -> None:
    CLOCK.now += seconds


def _step() -> None:
    _wait()
    _busy(0.03)


def _phase() -> None:
    _busy(0.02)


def _outer_step() -> None:  # its own time is nil, its cumulative time is the whole step
    _phase()
    _phase()


def test_rows_rank_functions_by_their_own_time_per_run():
    prof = host_profile(_step, runs=3, n=3, timer=CLOCK)
    rows = prof["by_self"]
    assert prof["runs"] == 3
    assert [r["function"].rsplit("(", 1)[1] for r in rows] == ["_wait)", "_busy)", "_step)"], rows
    wait, busy, step = rows
    assert wait["calls"] == busy["calls"] == 1  # per run, not 3
    assert wait["self_s"] == pytest.approx(0.05) and wait["share"] == pytest.approx(0.05 / 0.08)
    assert busy["self_s"] == busy["cum_s"] == pytest.approx(0.03)
    assert step["self_s"] == 0 and step["cum_s"] == pytest.approx(0.08)


def test_the_default_clock_is_the_wall_clock():
    prof = host_profile(lambda: time.sleep(0.05), runs=2, n=1)
    (top,) = prof["by_self"]
    assert top["function"] == "<built-in method time.sleep>" and top["calls"] == 1 and top["self_s"] >= 0.04


def test_cumulative_rows_show_the_phase_that_holds_the_time():
    prof = host_profile(_outer_step, runs=2, n=2, n_cumulative=3, timer=CLOCK)
    assert len(prof["by_self"]) == 2 and len(prof["by_cumulative"]) == 3
    cum = prof["by_cumulative"]
    assert [r["cum_s"] for r in cum] == sorted((r["cum_s"] for r in cum), reverse=True)
    outer = next(r for r in cum if r["function"].endswith("(_outer_step)"))
    phase = next(r for r in cum if r["function"].endswith("(_phase)"))
    assert outer["calls"] == 1 and phase["calls"] == 2  # per run
    assert outer["cum_s"] == pytest.approx(0.04) and outer["self_s"] == 0
    assert phase["cum_s"] == pytest.approx(outer["cum_s"])  # a run's two calls: all of the step


def test_root_rows_are_the_calls_of_a_loop_profiled_from_inside_it():
    """A loop that starts its profiler in its second iteration and stops it in its fifth: the calls the loop
    itself made in those 3 iterations are the root rows, with their time; the calls they made in turn are not
    (``_outer_step``'s own two ``_phase`` calls)."""
    profiler = cProfile.Profile(CLOCK)
    for i in range(5):  # this test's frame began before the profile: the loop
        if i == 1:
            profiler.enable()
        elif i == 4:
            profiler.disable()
            break
        _outer_step()
        _phase()
    prof = profile_rows(profiler, runs=3, roots=True)
    mine = {r["function"].rsplit("(", 1)[1][:-1]: r for r in prof["root_rows"] if "test_bench_host_profile" in r["function"]}
    assert set(mine) == {"_outer_step", "_phase"}, prof["root_rows"]  # _outer_step's two _phase calls are not roots
    assert mine["_outer_step"]["calls"] == mine["_phase"]["calls"] == 1  # per run
    assert mine["_outer_step"]["cum_s"] == pytest.approx(0.04)
    assert mine["_phase"]["cum_s"] == pytest.approx(0.02)  # the loop's own call only, not _outer_step's
    assert "root_rows" not in profile_rows(profiler, runs=3)


def _recurse(n: int) -> None:
    _phase()
    if n:
        _recurse(n - 1)


def test_a_recursive_root_counts_its_calls_from_the_loop_once_and_all_its_time():
    """pstats counts a recursive function's cumulative time at its outermost calls, which hold its calls of
    itself: a root row subtracts the calls it made of itself, not their time."""
    profiler = cProfile.Profile(CLOCK)
    for i in range(3):
        if i == 1:
            profiler.enable()
        _recurse(2)  # three _phase calls of 20 ms each
    profiler.disable()
    prof = profile_rows(profiler, runs=2, roots=True)
    root = next(r for r in prof["root_rows"] if r["function"].endswith("(_recurse)"))
    assert root["calls"] == 1  # per run: the loop's call, not the two it made of itself
    assert root["cum_s"] == pytest.approx(0.06)
    assert not any(r["function"].endswith("(_phase)") for r in prof["root_rows"])  # all called by _recurse


def test_runs_must_be_positive():
    with pytest.raises(ValueError, match="runs must be >= 1, got 0"):
        host_profile(_step, runs=0)


@pytest.mark.parametrize(("key", "name"), [
    (("/x/.venv/lib/python3.11/site-packages/deepspeed/runtime/engine.py", 3381, "backward"),
     "deepspeed/runtime/engine.py:3381(backward)"),
    (("/home/u/repo/comera_dist/engine/session.py", 250, "train_step"), "comera_dist/engine/session.py:250(train_step)"),
    (("/home/u/elsewhere/script.py", 3, "f"), "/home/u/elsewhere/script.py:3(f)"),
    (("~", 0, "<built-in method torch.bmm>"), "<built-in method torch.bmm>"),
])
def test_functions_are_named_from_their_package(key, name):
    assert _name(key) == name
