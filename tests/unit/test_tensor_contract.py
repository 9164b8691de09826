"""Every contraction path against the densified matrix, forward and backward (tensor/contract.py).

Paths: the one-einsum reference, the bidirectional ``(x L) R`` (through ``kernels.dispatch`` with the
torch backend), the sequential core-by-core order; for TTM the deduplicating pair lookup, the
pair reference without dedup and the naive per-core chain. The oracle is ``tt_to_dense`` /
``ttm_to_dense`` (itself checked entry by entry in test_tensor_formats.py).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from comera_dist.kernels import dispatch
from comera_dist.tensor import contract
from comera_dist.tensor.factorize import tt_ranks
from comera_dist.tensor.tt import tt_init, tt_to_dense
from comera_dist.tensor.ttm import ttm_init, ttm_to_dense

TAU = 1e-2


def _gates(ranks, gen):
    """Gate vectors with about a third of the entries below tau (and none near it)."""
    gates = []
    for r in ranks[1:-1]:
        g = torch.rand(r, generator=gen, dtype=torch.float64) + 0.5
        dead = torch.rand(r, generator=gen) < 0.35
        dead[0] = False  # a wholly dead bond would make the output identically zero
        g[dead] = 0.003
        gates.append(g.requires_grad_())
    return gates


def _mask(gates):
    return [g * (g > TAU) for g in gates]


def _tt_lr(x, cores, masks, d):
    with dispatch.use_backend("torch"):
        return dispatch.tt_linear(x, contract.contract_left(cores[:d], masks[:d]),
                                  contract.contract_right(cores[d:], masks[d:]))


TT_PATHS = {
    "einsum": contract.tt_linear_einsum,
    "lr": _tt_lr,
    "sequential": contract.tt_linear_sequential,
}


def _tt_case(in_modes, out_modes, max_rank, tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    ranks = tt_ranks(in_modes + out_modes, max_rank)
    cores = [c.requires_grad_() for c in tt_init(in_modes, out_modes, ranks, 1.0, gen, torch.float64)]
    gates = _gates(ranks, gen)
    x = torch.randn(tokens, math.prod(in_modes), generator=gen, dtype=torch.float64, requires_grad=True)
    return x, cores, gates


def _grads(out, leaves, seed=0):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return torch.autograd.grad((out * w).sum(), leaves, retain_graph=True)


def _check_tt_path(name, x, cores, gates, d):
    leaves = [x, *cores, *gates]
    want = x @ tt_to_dense(cores, _mask(gates), d)  # (T, N_out)
    got = TT_PATHS[name](x, cores, _mask(gates), d)
    torch.testing.assert_close(got, want)
    for gw, gg in zip(_grads(want, leaves), _grads(got, leaves)):
        torch.testing.assert_close(gg, gw)
    # A masked-out gate entry gets exactly zero gradient (the mask is a hard threshold).
    g_grads = _grads(got, gates)
    for g, gr in zip(gates, g_grads):
        assert torch.all(gr[g <= TAU] == 0)
        assert torch.any(gr[g > TAU] != 0)


@pytest.mark.parametrize("name", sorted(TT_PATHS))
@pytest.mark.parametrize("in_modes, out_modes", [
    ([3], [4]), ([2, 3], [3, 2]), ([2, 3], [2]), ([2, 2, 2], [2, 3, 2]), ([2, 2, 2, 2], [2, 2, 2, 2]),
])
def test_tt_paths_match_dense_forward_backward(name, in_modes, out_modes):
    x, cores, gates = _tt_case(in_modes, out_modes, 3, 5, seed=len(in_modes) * 10 + len(out_modes))
    _check_tt_path(name, x, cores, gates, len(in_modes))


@pytest.mark.parametrize("name", sorted(TT_PATHS))
@pytest.mark.parametrize("in_modes, out_modes", [([3], [4]), ([2, 3], [3, 2]), ([2, 1, 2], [1, 3])])
def test_tt_paths_take_zero_tokens(name, in_modes, out_modes):
    x, cores, gates = _tt_case(in_modes, out_modes, 3, 0, seed=1)
    got = TT_PATHS[name](x, cores, _mask(gates), len(in_modes))
    assert got.shape == (0, math.prod(out_modes))
    grads = torch.autograd.grad(got.sum(), [x, *cores, *gates])
    assert grads[0].shape == x.shape and all(not g.any() for g in grads[1:])


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_tt_paths_random_shapes(data):
    num_cores = data.draw(st.integers(2, 8), label="num_cores")
    d = data.draw(st.integers(1, num_cores - 1), label="d")
    modes = data.draw(st.lists(st.integers(1, 3), min_size=num_cores, max_size=num_cores), label="modes")
    max_rank = data.draw(st.integers(1, 4), label="max_rank")
    tokens = data.draw(st.integers(1, 6), label="tokens")
    x, cores, gates = _tt_case(modes[:d], modes[d:], max_rank, tokens, seed=data.draw(st.integers(0, 99)))
    want = x @ tt_to_dense(cores, _mask(gates), d)
    leaves = [x, *cores, *gates]
    gw = _grads(want, leaves)
    for name, path in TT_PATHS.items():
        got = path(x, cores, _mask(gates), d)
        torch.testing.assert_close(got, want, msg=name)
        for a, b in zip(_grads(got, leaves), gw):
            torch.testing.assert_close(a, b, msg=name)


@pytest.mark.parametrize("num_cores", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("name", sorted(TT_PATHS))
def test_tt_paths_gradcheck(name, num_cores):
    d = (num_cores + 1) // 2
    modes = [2, 3, 2, 2, 3, 2, 2, 2][:num_cores]
    x, cores, gates = _tt_case(modes[:d], modes[d:], 2, 3, seed=num_cores)
    path = TT_PATHS[name]

    def f(x, *params):
        cs, gs = list(params[:num_cores]), list(params[num_cores:])
        return path(x, cs, _mask(gs), d)

    assert torch.autograd.gradcheck(f, (x, *cores, *gates), eps=1e-6, atol=1e-7)


def test_tt_lr_bias_and_mask_convention():
    """``L`` carries the middle mask; ``R`` only the output-side bonds; bias is added once."""
    x, cores, gates = _tt_case([2, 3], [3, 2], 3, 4, seed=5)
    masks = _mask(gates)
    L = contract.contract_left(cores[:2], masks[:2])
    R = contract.contract_right(cores[2:], masks[2:])
    assert L.shape == (6, cores[1].shape[2]) and R.shape == (cores[2].shape[0], 6)
    torch.testing.assert_close(L @ R, tt_to_dense(cores, masks, 2))
    assert torch.all(L[:, masks[1] == 0] == 0)  # columns of dead middle ranks are zero
    b = torch.randn(6, dtype=torch.float64)
    torch.testing.assert_close(contract.tt_linear_lr(x, L, R, b), x @ L @ R + b)


# ---------------------------------------------------------------------------------------------
# TTM lookups
# ---------------------------------------------------------------------------------------------


def _ttm_case(row_modes, col_modes, max_rank, tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    ranks = tt_ranks([m * n for m, n in zip(row_modes, col_modes)], max_rank)
    cores = [c.requires_grad_() for c in ttm_init(row_modes, col_modes, ranks, 1.0, gen, torch.float64)]
    gates = _gates(ranks, gen)
    rows = math.prod(row_modes)
    ids = torch.randint(0, rows, (tokens,), generator=gen)
    ids[: tokens // 2] = ids[0]  # duplicates exercise the dedup path
    return ids, cores, gates


def _pairs(fn):
    def run(ids, cores, masks):
        A, B = contract.ttm_pair_contract(cores, masks)
        return fn(ids, A, B)
    return run


def _dispatch_lookup(ids, A, B):
    with dispatch.use_backend("torch"):
        return dispatch.ttm_lookup(ids, A, B)


def _dispatch_static(ids, A, B):
    with dispatch.use_backend("torch"), dispatch.static_shapes():
        return dispatch.ttm_lookup(ids, A, B)


# "pairs_static" covers both static branches: few rows (num_cores 2: 6 rows < 9 tokens, the
# whole table once) and many (one product per token).
TTM_PATHS = {
    "pairs_dedup": _pairs(contract.ttm_lookup_pairs),
    "pairs_static": _pairs(lambda ids, A, B: contract.ttm_lookup_pairs(ids, A, B, dedup="static")),
    "dispatch_static": _pairs(_dispatch_static),
    "pairs_reference": _pairs(contract.ttm_lookup_reference),
    "dispatch": _pairs(_dispatch_lookup),
    "naive": contract.ttm_lookup_naive,
}


@pytest.mark.parametrize("num_cores", [2, 3, 4, 5, 6, 7, 8])
def test_ttm_paths_match_dense_forward_backward(num_cores):
    row_modes = [3, 2, 2, 3, 2, 2, 2, 2][:num_cores]
    col_modes = [2, 1, 2, 2, 1, 2, 1, 2][:num_cores]
    ids, cores, gates = _ttm_case(row_modes, col_modes, 3, 9, seed=num_cores)
    leaves = [*cores, *gates]
    want = ttm_to_dense(cores, _mask(gates))[ids]  # (T, N)
    gw = _grads(want, leaves)
    for name, path in TTM_PATHS.items():
        got = path(ids, cores, _mask(gates))
        torch.testing.assert_close(got, want, msg=name)
        for a, b in zip(_grads(got, leaves), gw):
            torch.testing.assert_close(a, b, msg=name)


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_ttm_paths_random_shapes(data):
    D = data.draw(st.integers(2, 6), label="num_cores")
    row_modes = data.draw(st.lists(st.integers(1, 4), min_size=D, max_size=D), label="row_modes")
    col_modes = data.draw(st.lists(st.integers(1, 3), min_size=D, max_size=D), label="col_modes")
    ids, cores, gates = _ttm_case(row_modes, col_modes, data.draw(st.integers(1, 4)),
                                  data.draw(st.integers(1, 12)), seed=data.draw(st.integers(0, 99)))
    want = ttm_to_dense(cores, _mask(gates))[ids]
    for name, path in TTM_PATHS.items():
        torch.testing.assert_close(path(ids, cores, _mask(gates)), want, msg=name)


@pytest.mark.parametrize("num_cores", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("name", sorted(TTM_PATHS))
def test_ttm_paths_gradcheck(name, num_cores):
    ids, cores, gates = _ttm_case([2, 3, 2, 2, 2, 2, 2, 2][:num_cores], [2, 1, 2, 1, 1, 2, 1, 1][:num_cores], 2, 6,
                                  seed=num_cores)
    path = TTM_PATHS[name]

    def f(*params):
        return path(ids, list(params[:num_cores]), _mask(list(params[num_cores:])))

    assert torch.autograd.gradcheck(f, (*cores, *gates), eps=1e-6, atol=1e-7)


def test_ttm_pair_split_shapes():
    _ids, cores, gates = _ttm_case([2, 3, 2, 5], [2, 1, 3, 2], 3, 4, seed=0)
    A, B = contract.ttm_pair_contract(cores, _mask(gates))
    assert contract.ttm_split(4) == 2 and contract.ttm_split(5) == 3
    assert A.shape == (6, 2, cores[2].shape[0]) and B.shape == (cores[2].shape[0], 10, 6)
    with pytest.raises(ValueError, match="at least 2 cores, got 1"):
        contract.ttm_pair_contract(cores[:1], None)


def test_ttm_head_contract_and_einsum_refuse_bad_shapes():
    """A width that is not N_L*N_R is a clear error, not a reshape failure; so is a chain past the
    einsum's letters (25 cores: 51 subscripts for 50 letters)."""
    left, right = torch.randn(3, 2, 4), torch.randn(4, 5, 3)  # E: (15, 6)
    for side in ("left", "right"):
        with pytest.raises(ValueError, match=r"h must be \(T, 6\) \(the embedding width\), got shape \(2, 5\)"):
            contract.ttm_head_contract(torch.randn(2, 5), left, right, side)
    cores = [torch.ones(1, 1, 1) for _ in range(25)]
    with pytest.raises(ValueError, match=r"at most 24 cores, got 25"):
        contract.tt_linear_einsum(torch.ones(2, 1), cores, None, 12)
    assert contract.tt_linear_einsum(torch.ones(2, 1), cores[:24], None, 12).shape == (2, 1)
