"""Mode factorization and the capped rank profile (tensor/factorize.py)."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comera_dist.tensor.factorize import check_modes, check_ranks, factorize, factorize_at_least, tt_ranks


@pytest.mark.parametrize("n, d, expected", [
    (768, 3, [12, 8, 8]), (3072, 3, [16, 16, 12]), (768, 2, [32, 24]), (768, 4, [8, 6, 4, 4]),
    (7, 2, [7, 1]), (1, 3, [1, 1, 1]), (64, 6, [2, 2, 2, 2, 2, 2]),
])
def test_factorize_known(n, d, expected):
    assert factorize(n, d) == expected


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5000), d=st.integers(1, 6))
def test_factorize_exact_descending_and_balanced(n, d):
    f = factorize(n, d)
    assert len(f) == d and math.prod(f) == n and f == sorted(f, reverse=True)
    # No exact factorization has a smaller largest factor (brute force over divisors).
    best = min(max(c) for c in _all_factorizations(n, d))
    assert f[0] == best


def _all_factorizations(n, d):
    if d == 1:
        yield (n,)
        return
    for f in range(1, n + 1):
        if n % f == 0:
            for rest in _all_factorizations(n // f, d - 1):
                yield (f, *rest)


def test_factorize_at_least_pads_the_vocabulary():
    f = factorize_at_least(30522, 4)
    assert math.prod(f) >= 30522 and math.prod(f) - 30522 < 0.01 * 30522, f
    assert max(f) == math.ceil(30522 ** 0.25)  # as balanced as any padding allows
    assert factorize_at_least(1000, 3) == [10, 10, 10]  # an exact factorization needs no padding


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 20000), d=st.integers(2, 5))
def test_factorize_at_least_covers(n, d):
    f = factorize_at_least(n, d)
    assert len(f) == d and math.prod(f) >= n and max(f) == math.ceil(round(n ** (1 / d), 9))


def test_tt_ranks_caps_paper_profiles():
    assert tt_ranks([12, 8, 8, 8, 8, 12], 30) == [1, 12, 30, 30, 30, 12, 1]
    assert tt_ranks([12, 8, 8, 12, 16, 16], 30) == [1, 12, 30, 30, 30, 16, 1]
    assert tt_ranks([16 * 4, 20 * 4, 10 * 8, 10 * 6], 32) == [1, 32, 32, 32, 1]
    assert tt_ranks([2, 3, 4], 100) == [1, 2, 4, 1]


@pytest.mark.parametrize("call, match", [
    (lambda: factorize(0, 2), r"n must be an int >= 1, got 0"),
    (lambda: factorize(12, 0), r"d must be an int >= 1, got 0"),
    (lambda: tt_ranks([4, 4], 0), r"max_rank must be an int >= 1, got 0"),
    (lambda: tt_ranks([4, 0], 3), r"modes\[1\] must be an int >= 1, got 0"),
    (lambda: check_modes("in_modes", [4, 4], 20), r"in_modes=\[4, 4\] has product 16, which differs from .* 20"),
    (lambda: check_modes("row_modes", [4, 4], 20, at_least=True), r"row_modes=\[4, 4\] has product 16 < 20"),
    (lambda: check_ranks("ranks", [1, 0, 1], 2), r"ranks\[1\] must be an int >= 1 \(rank\), got 0"),
    (lambda: check_ranks("ranks", [1, 3, 1], 3), r"ranks must be a list of 4 ints"),
    (lambda: check_ranks("ranks", [2, 3, 1], 2), r"ranks must start and end with 1, got \[2, 3, 1\]"),
    (lambda: check_ranks("ranks", [1, 9, 1], 2, [1, 4, 1]), r"ranks\[1\]=9 exceeds the largest useful rank 4"),
    (lambda: check_ranks("ranks", [1, 5, 1], 2, [1, 4, 1]), r"ranks\[1\]=5 exceeds the largest useful rank 4"),
    (lambda: check_ranks("ranks", [1, 3, 2], 2), r"ranks must start and end with 1, got \[1, 3, 2\]"),
])
def test_bad_input_names_parameter_and_value(call, match):
    with pytest.raises(ValueError, match=match):
        call()
