"""The soak benchmark's RSS drift: last-quarter median over first-quarter median, minus 1."""

import pytest

from comera_dist.bench.soak import rss_bytes, rss_drift


def test_rss_drift_compares_quarter_medians():
    assert rss_drift([100] * 8) == 0.0
    assert rss_drift([100, 100, 500, 5, 103, 103, 103, 104]) == pytest.approx(0.035)  # medians 100 -> 103.5
    assert rss_drift([10, 20]) == 1.0
    assert rss_bytes() > 1 << 20
