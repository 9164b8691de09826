"""TT and TTM formats (tensor/tt.py, tensor/ttm.py) against an entry-by-entry brute-force oracle."""

import itertools
import math

import pytest
import torch

from comera_dist.tensor.factorize import tt_ranks
from comera_dist.tensor.tt import core_stds, scale_bonds, tt_init, tt_svd, tt_svd_modes, tt_to_dense
from comera_dist.tensor.ttm import ttm_init, ttm_svd, ttm_to_dense


def brute_tt(cores, masks, d):
    """W[i, j] as the product of the core slices picked by the row-major digits of i and j."""
    in_modes = [c.shape[1] for c in cores[:d]]
    out_modes = [c.shape[1] for c in cores[d:]]
    W = torch.empty(math.prod(in_modes), math.prod(out_modes), dtype=cores[0].dtype)
    for i, ii in enumerate(itertools.product(*map(range, in_modes))):
        for j, jj in enumerate(itertools.product(*map(range, out_modes))):
            v = cores[0][:, ii[0] if d else jj[0], :]
            for k, idx in enumerate((ii + jj)[1:], start=1):
                v = v * masks[k - 1] if masks is not None else v
                v = v @ cores[k][:, idx, :]
            W[i, j] = v.squeeze()
    return W


def brute_ttm(cores, masks):
    rows = [c.shape[1] for c in cores]
    cols = [c.shape[2] for c in cores]
    E = torch.empty(math.prod(rows), math.prod(cols), dtype=cores[0].dtype)
    for i, ii in enumerate(itertools.product(*map(range, rows))):
        for j, jj in enumerate(itertools.product(*map(range, cols))):
            v = cores[0][:, ii[0], jj[0], :]
            for k in range(1, len(cores)):
                v = v * masks[k - 1] if masks is not None else v
                v = v @ cores[k][:, ii[k], jj[k], :]
            E[i, j] = v.squeeze()
    return E


def _masks(ranks, gen):
    """Gate masks with some entries zeroed (as g * [g > tau] produces) and the rest scaled."""
    out = []
    for r in ranks[1:-1]:
        m = torch.rand(r, generator=gen, dtype=torch.float64) + 0.5
        m[torch.rand(r, generator=gen) < 0.3] = 0.0
        out.append(m)
    return out


@pytest.mark.parametrize("in_modes, out_modes", [([3], [2]), ([2, 3], [3, 2]), ([2, 2, 2], [3, 1, 2]),
                                                 ([2, 3, 2], [2]), ([2, 2, 2, 2], [2, 2, 2, 2])])
def test_tt_to_dense_matches_brute_force(in_modes, out_modes):
    gen = torch.Generator().manual_seed(0)
    ranks = tt_ranks(in_modes + out_modes, 3)
    cores = tt_init(in_modes, out_modes, ranks, 1.0, gen, torch.float64)
    masks = _masks(ranks, gen)
    d = len(in_modes)
    torch.testing.assert_close(tt_to_dense(cores, masks, d), brute_tt(cores, masks, d))
    torch.testing.assert_close(tt_to_dense(cores, None, d), brute_tt(cores, None, d))


@pytest.mark.parametrize("row_modes, col_modes", [([3, 2], [2, 2]), ([2, 3, 2], [1, 2, 3]), ([2, 2, 2, 2], [2, 1, 2, 1])])
def test_ttm_to_dense_matches_brute_force(row_modes, col_modes):
    gen = torch.Generator().manual_seed(1)
    ranks = tt_ranks([m * n for m, n in zip(row_modes, col_modes)], 3)
    cores = ttm_init(row_modes, col_modes, ranks, 1.0, gen, torch.float64)
    masks = _masks(ranks, gen)
    torch.testing.assert_close(ttm_to_dense(cores, masks), brute_ttm(cores, masks))


@pytest.mark.parametrize("in_modes, out_modes", [([4], [6]), ([2, 3], [4, 2]), ([3, 2, 2], [2, 2, 3]),
                                                 ([2, 2, 2, 2], [2, 2, 2, 2])])
def test_tt_svd_exact_at_full_rank(in_modes, out_modes):
    W = torch.randn(math.prod(in_modes), math.prod(out_modes), dtype=torch.float64)
    cores = tt_svd(W, in_modes, out_modes, max_rank=10**6)
    assert [c.shape[0] for c in cores] + [1] == tt_ranks(in_modes + out_modes, 10**6)
    torch.testing.assert_close(tt_to_dense(cores, None, len(in_modes)), W, rtol=1e-10, atol=1e-10)


def test_tt_svd_truncates_to_the_capped_ranks_and_is_optimal_for_two_cores():
    W = torch.randn(12, 10, dtype=torch.float64)
    cores = tt_svd(W, [12], [10], max_rank=3)
    assert [tuple(c.shape) for c in cores] == [(1, 12, 3), (3, 10, 1)]
    s = torch.linalg.svdvals(W)
    err = torch.linalg.norm(tt_to_dense(cores, None, 1) - W)
    torch.testing.assert_close(err, s[3:].norm())  # Eckart-Young: the best rank-3 approximation


def test_ttm_svd_exact_at_full_rank_with_vocab_padding():
    E = torch.randn(10, 6, dtype=torch.float64)  # 10 rows in a 3*4 = 12-row TTM
    cores = ttm_svd(E, [3, 4], [2, 3], max_rank=10**6)
    full = ttm_to_dense(cores, None)
    assert full.shape == (12, 6)
    torch.testing.assert_close(full[:10], E, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(full[10:], torch.zeros(2, 6, dtype=torch.float64), atol=1e-10, rtol=0)


@pytest.mark.parametrize("num_cores", [2, 4, 6])
def test_init_gives_the_target_entry_std(num_cores):
    """Each entry of the product has std s (method doc section 1); averaged over seeds."""
    d = num_cores // 2
    in_modes, out_modes = [4] * d, [4] * d
    ranks = tt_ranks(in_modes + out_modes, 8)
    s = 0.05
    var = torch.stack([tt_to_dense(tt_init(in_modes, out_modes, ranks, s, torch.Generator().manual_seed(i),
                                           torch.float64), None, d).pow(2).mean() for i in range(40)]).mean()
    assert abs(var.sqrt().item() / s - 1) < 0.1, var.sqrt().item()


def test_ttm_init_gives_the_target_entry_std():
    s = 0.125
    ranks = tt_ranks([12, 12, 12], 8)
    var = torch.stack([ttm_to_dense(ttm_init([4, 4, 4], [3, 3, 3], ranks, s, torch.Generator().manual_seed(i),
                                             torch.float64), None).pow(2).mean() for i in range(40)]).mean()
    assert abs(var.sqrt().item() / s - 1) < 0.1, var.sqrt().item()


def test_format_bad_input():
    with pytest.raises(ValueError, match=r"in_modes=\[5, 5\] has product 25, which differs from the dimension 24"):
        tt_svd(torch.randn(24, 6), [5, 5], [6], 4)
    with pytest.raises(ValueError, match=r"row_modes=\[3, 3\] has product 9 < 10"):
        ttm_svd(torch.randn(10, 4), [3, 3], [2, 2], 4)
    with pytest.raises(ValueError, match=r"init std must be > 0, got 0"):
        tt_init([2], [2], [1, 2, 1], 0.0)
    with pytest.raises(ValueError, match=r"ranks has length 4, expected 3"):
        tt_init([2], [2], [1, 2, 2, 1], 1.0)  # one rank too many: would drop or misplace a core
    with pytest.raises(ValueError, match=r"ranks has length 2, expected 3"):
        tt_init([2], [2], [1, 1], 1.0)
    with pytest.raises(ValueError, match=r"ranks has length 2, expected 3"):
        ttm_init([2, 2], [2, 2], [1, 1], 1.0)  # would silently build a single core
    with pytest.raises(ValueError, match=r"row_modes \[2, 2\] and col_modes \[2, 2, 2\] must have the same length"):
        ttm_init([2, 2], [2, 2, 2], [1, 2, 1], 1.0)  # would silently drop the last column mode
    with pytest.raises(ValueError, match=r"row_modes \[2, 5\] and col_modes \[4\] must have the same length"):
        ttm_svd(torch.randn(10, 4), [2, 5], [4], 4)
    with pytest.raises(ValueError, match=r"rank 3 at bond 1 exceeds the unfolding rank limit 2"):
        tt_svd_modes(torch.randn(6), [2, 3], [1, 3, 1])  # a (2 x 3) unfolding has 2 singular values
    with pytest.raises(ValueError, match=r"3 masks for 2 cores"):
        scale_bonds([torch.ones(1, 2, 2), torch.ones(2, 2, 1)], [torch.ones(2), torch.ones(1), torch.ones(1)])


def test_core_stds_divide_by_the_right_rank():
    """Method doc section 1: ``G_k ~ N(0,1)/sqrt(r_k) * s^(1/#cores)``, r_k the core's *right* rank.
    (Dividing by r_{k-1} gives the same product variance, so the entry-std tests cannot tell.)"""
    s, ranks = 0.3, [1, 3, 5, 1]
    root = s ** (1 / 3)
    assert core_stds(ranks, s) == pytest.approx([root / math.sqrt(3), root / math.sqrt(5), root])
    cores = tt_init([40], [40, 40], ranks, s, torch.Generator().manual_seed(0), torch.float64)
    for c, want in zip(cores, core_stds(ranks, s)):
        assert abs(c.std().item() / want - 1) < 0.15


def test_tt_svd_balances_the_core_norms():
    """TT-SVD leaves the norm in the last core; ``_balance`` spreads it evenly, product unchanged."""
    W = torch.randn(12, 10, dtype=torch.float64) * 7
    cores = tt_svd(W, [3, 4], [5, 2], max_rank=10**6)
    norms = torch.stack([c.norm() for c in cores])
    torch.testing.assert_close(norms, norms.mean().expand(4), rtol=1e-10, atol=0)
    torch.testing.assert_close(tt_to_dense(cores, None, 2), W, rtol=1e-10, atol=1e-10)
