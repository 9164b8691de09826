"""``metrics.history.History``: every value of a short run; bounded, evenly thinned series for a long one, with
the first and latest values and the extremes exact."""

from __future__ import annotations

import itertools
import math
import tracemalloc

import pytest

from comera_dist.metrics.history import History
from comera_dist.metrics.report import write_report


def test_a_short_run_keeps_every_value_in_order():
    h = History(max_points=10)
    for step in range(10):
        h.add_scalars({"loss": 10.0 - step, "lr": 0.1}, step)
    assert h.scalars["loss"] == [(s, 10.0 - s) for s in range(10)]
    assert h.last("loss") == 1.0 and h.best("loss") == (9, 1.0) and h.best("loss", lowest=False) == (0, 10.0)
    assert h.last("missing") is None and h.best("missing") is None


# (budget, values): 99 thins at the 100th and the 199th value, where the latest sampled point is an odd one
@pytest.mark.parametrize("budget,count", [(100, 1000), (100, 1001), (100, 1024), (100, 1025), (100, 4097),
                                          (99, 100), (99, 199), (99, 1000)])
def test_a_long_series_is_bounded_evenly_spaced_with_its_first_latest_and_extremes(budget, count):
    h = History(max_points=budget)
    logged = []
    for step in range(count):
        value = math.sin(step) + (5.0 if step == 777 else 0.0) - (7.0 if step == 83 else 0.0)
        logged.append((10 * step, value if step % 97 else math.nan))
        h.add_scalars({"loss": logged[-1][1]}, 10 * step)
    points = h.scalars["loss"]
    assert len(points) <= budget + 1  # max_points, plus the latest value when it was not sampled
    assert points[0][0] == 0 and math.isnan(points[0][1])  # the first value (step 0's NaN), always
    assert points[-1][0] == 10 * (count - 1)  # the latest value, always
    sampled = [s for s, _ in points[:-1]]
    gaps = {b - a for a, b in itertools.pairwise(sampled)}
    assert len(gaps) == 1, gaps  # evenly spaced
    assert len(points) >= budget // 2  # thinned by halves: never below half the budget
    # the extremes are exact although the steps of the spikes (83 and 777) need not be among the points
    finite = [(s, v) for s, v in logged if math.isfinite(v)]
    assert h.best("loss") == min(finite, key=lambda sv: sv[1]) == (830, math.sin(83) - 7.0)
    assert h.best("loss", lowest=False) == max(finite, key=lambda sv: sv[1])
    assert points == sorted(points) and all(p in logged or math.isnan(p[1]) for p in points)


def test_rank_snapshots_thin_the_same_way():
    h = History(max_points=10, max_rank_snapshots=8)
    for step in range(0, 1000, 10):
        h.add_ranks({"layer": [step // 10, 3]}, step)
    ranks = h.ranks
    assert len(ranks) <= 9 and ranks[0] == (0, {"layer": [0, 3]}) and ranks[-1] == (990, {"layer": [99, 3]})


def test_memory_stays_bounded_over_a_long_run():
    h = History(max_points=500)
    keys = ("train_loss", "tokens_per_second", "step_time_seconds", "learning_rate")
    for step in range(2000):  # past the budget: the rest must not grow the history
        h.add_scalars({k: float(step) for k in keys}, step)
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for step in range(2000, 50_000):
        h.add_scalars({k: float(step) for k in keys}, step)
    grown = sum(d.size_diff for d in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    # unbounded, 48,000 more steps of 4 keys kept about 22 MB of tuples
    assert grown < 256 * 1024, grown
    assert all(len(h.scalars[k]) <= 501 for k in keys)


def test_the_report_of_a_thinned_run_gives_the_true_first_last_min_and_max(tmp_path):
    h = History(max_points=16)
    for step in range(1, 1001):
        h.add_scalars({"train_loss": 2.0 + math.cos(step) + (-10.0 if step == 501 else 0.0)}, step)
    text = write_report(h, tmp_path, run_name="long", world_size=1, total_steps=1000).read_text()
    row = next(line for line in text.splitlines() if line.startswith("| train_loss |"))
    first, last, low, high = (float(c) for c in row.strip("|").split("|")[1:])
    assert first == pytest.approx(2.0 + math.cos(1), rel=1e-5) and last == pytest.approx(2.0 + math.cos(1000), rel=1e-5)
    assert low == pytest.approx(-8.0 + math.cos(501), rel=1e-5)
    assert high == pytest.approx(max(2.0 + math.cos(s) for s in range(1, 1001)), rel=1e-5)
    assert "- last step logged: 1000" in text


@pytest.mark.parametrize("name", ["max_points", "max_rank_snapshots"])
def test_a_budget_below_two_points_is_refused(name):
    with pytest.raises(ValueError, match=f"History.{name} must be >= 2"):
        History(**{name: 1})


def _fill(h: History, start: int, stop: int) -> None:
    for step in range(start, stop):
        h.add_scalars({"loss": 10.0 / step, "stage": float(step > 30)}, step)
        if step % 5 == 0:
            h.add_ranks({"layer": [step % 7, 3]}, step)
        if step % 10 == 0:
            h.checkpoints.append((step, True, float(step)))


def test_a_saved_history_continues_as_if_it_never_stopped():
    """A resumed job continues the history saved at its checkpoint (through JSON, as on disk): the same points,
    thinning, extremes and checkpoints as one job that ran through."""
    import json

    through, first = History(max_points=8, max_rank_snapshots=4), History(max_points=8, max_rank_snapshots=4)
    _fill(through, 1, 60)
    _fill(first, 1, 40)
    resumed = History.from_state(json.loads(json.dumps(first.state())))
    _fill(resumed, 40, 60)
    assert json.loads(json.dumps(resumed.state())) == json.loads(json.dumps(through.state()))
    assert resumed.scalars == through.scalars and resumed.ranks == through.ranks
    assert resumed.best("loss") == through.best("loss") and resumed.checkpoints == through.checkpoints


def test_a_history_cut_at_an_older_checkpoint_drops_what_came_after():
    """A job resumed from an older checkpoint than the history's last: the steps after it are gone, extremes too."""
    h = History(max_points=100)
    _fill(h, 1, 40)
    cut = History.from_state(h.state(), upto=20)
    assert max(s for s, _ in cut.scalars["loss"]) == 20 and cut.scalars["loss"][0] == (1, 10.0)
    assert cut.best("loss") == (20, 0.5) and cut.best("stage", lowest=False) == (1, 0.0)
    assert [s for s, _, _ in cut.checkpoints] == [10, 20] and max(s for s, _ in cut.ranks) == 20


@pytest.mark.parametrize("budget", [4, 100])
def test_a_step_logged_again_keeps_its_first_point_and_extremes(budget):
    """A resumed job logs its starting values at the checkpoint's step, which the continued history already
    holds: one point per step (the series' steps stay distinct), the first value stands, in the series and in
    the extremes, and thinning counts that step once."""
    once, again = History(max_points=budget), History(max_points=budget)
    for step in range(1, 41):
        once.add_scalars({"ratio": float(step)}, step)
        again.add_scalars({"ratio": float(step)}, step)
        once.add_ranks({"layer": [1]}, step)
        again.add_ranks({"layer": [1]}, step)
        if step == 20:  # the resumed job's starting values: another process's, e.g. a fresh peak memory
            again.add_scalars({"ratio": 99.0}, 20)
            again.add_ranks({"layer": [2]}, 20)
    assert again.scalars == once.scalars and again.ranks == once.ranks
    assert again.best("ratio", lowest=False) == once.best("ratio", lowest=False) == (40, 40.0)
    steps = [s for s, _ in again.scalars["ratio"]]
    assert len(steps) == len(set(steps))


def test_extremes_skip_infinities_and_keep_the_first_step_of_a_tie():
    h = History(max_points=10)
    for step, value in enumerate([3.0, math.inf, 1.0, -math.inf, 1.0, 5.0, 5.0, math.nan]):
        h.add_scalars({"val_loss": value}, step)
    assert h.best("val_loss") == (2, 1.0)  # the first step that reached the best loss, not a later tie
    assert h.best("val_loss", lowest=False) == (5, 5.0)  # finite: an overflowed loss is not the run's maximum


def test_a_cut_history_drops_its_held_latest_point_but_no_sampled_one():
    """The saved history held an unsampled latest point after its sampled ones; a cut before it drops it, and
    what the resumed job logs next must not push out the last sampled point that is left."""
    h = History(max_points=8)
    for step in range(1, 101):
        h.add_scalars({"loss": float(step)}, step)
    assert h.state()["scalars"]["loss"]["tail"] is True and h.scalars["loss"][-1] == (100, 100.0)
    cut = History.from_state(h.state(), upto=90)
    kept = list(cut.scalars["loss"])
    assert kept[-1][0] <= 90 and kept[0] == (1, 1.0)
    cut.add_scalars({"loss": 90.5}, 90)
    cut.add_scalars({"loss": 91.0}, 91)
    assert cut.scalars["loss"][: len(kept)] == kept


def test_a_series_logged_only_after_the_cut_is_gone_and_the_report_still_writes(tmp_path):
    """Resumed from a checkpoint older than the first value of a series (a late-stage key, the first
    evaluation): that series has no point left. It is absent, not an empty series that broke ``last`` and the
    report's table (IndexError when the job closed)."""
    h = History()
    for step in range(1, 11):
        h.add_scalars({"train_loss": 1.0 / step}, step)
        if step >= 6:
            h.add_scalars({"val_loss": 2.0, "lambda": 1.0}, step)
    cut = History.from_state(h.state(), upto=4)
    assert set(cut.scalars) == {"train_loss"}
    assert cut.last("val_loss") is None and cut.best("val_loss") is None
    text = write_report(cut, tmp_path, run_name="cut", world_size=1, total_steps=10).read_text()
    assert "| train_loss | 1 | 0.25 | 0.25 | 1 |" in text and "val_loss" not in text
    assert "- last step logged: 4" in text
    cut.add_scalars({"val_loss": 1.5}, 5)  # logged again by the resumed job: a fresh series
    assert cut.scalars["val_loss"] == [(5, 1.5)] and cut.best("val_loss") == (5, 1.5)
