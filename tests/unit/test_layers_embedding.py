"""TTEmbedding: lookup vs the densified table, no table in forward, padding, conversion (layers/embedding.py)."""

import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from tt_cases import gated_embedding

from comera_dist.layers import TTEmbedding


@pytest.mark.parametrize("num_cores", [2, 3, 4, 5, 6, 8])
def test_lookup_matches_table_forward_backward(num_cores):
    emb = gated_embedding(V=200, N=16, num_cores=num_cores)
    assert math.prod(emb.row_modes) >= 200
    ids = torch.randint(0, 200, (3, 7))
    ids[0, :4] = 5  # repeated ids
    table = emb.table()
    out = emb(ids)
    assert out.shape == (3, 7, 16)
    torch.testing.assert_close(out, table[ids])
    w = torch.randn_like(out)
    got = torch.autograd.grad((emb(ids) * w).sum(), list(emb.parameters()))
    want = torch.autograd.grad((emb.table()[ids] * w).sum(), list(emb.parameters()))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_gradcheck():
    emb = gated_embedding(V=30, N=4, num_cores=3, max_rank=3)
    ids = torch.tensor([0, 7, 7, 29, 13])
    names = [n for n, _ in emb.named_parameters()]

    def f(*ps):
        return torch.func.functional_call(emb, dict(zip(names, ps)), (ids,))

    assert torch.autograd.gradcheck(f, tuple(emb.parameters()), eps=1e-6, atol=1e-7)


def test_vocab_padding_rows_are_never_read():
    emb = TTEmbedding(30522, 768, row_modes=[16, 20, 10, 10], col_modes=[4, 4, 8, 6], max_rank=32)
    assert math.prod(emb.row_modes) == 32000
    auto = TTEmbedding(30522, 64, num_cores=4, max_rank=4)
    assert math.prod(auto.row_modes) >= 30522 and math.prod(auto.col_modes) == 64
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 30522\), got min 0 max 30522"):
        auto(torch.tensor([0, 30522]))


class _MaxNumel(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_forward_and_backward_never_build_the_table():
    emb = TTEmbedding(30522, 768, row_modes=[16, 20, 10, 10], col_modes=[4, 4, 8, 6], max_rank=32)
    ids = torch.randint(0, 30522, (64,))
    with _MaxNumel() as mode:
        emb(ids).sum().backward()
    # The largest tensor is a pair half (32 x 10*10 x 8*6 = 153,600), the output, or the gradient of the
    # flat core parameter (every core end to end, 167,808): nothing near the table's 23.4 M.
    assert emb.core.numel() == 167_808
    assert mode.max_numel <= max(64 * 768, 32 * 100 * 48, 320 * 16 * 32, emb.core.numel()), mode.max_numel


def test_padding_idx_rows_are_zero_and_get_no_gradient():
    emb = gated_embedding(V=40, N=6, padding_idx=3)
    ids = torch.tensor([[3, 1, 3, 7], [2, 3, 9, 9]])
    out = emb(ids)
    assert torch.all(out[ids == 3] == 0) and torch.all(out[ids != 3].abs().sum(-1) > 0)
    w = torch.randn_like(out)
    g_all = torch.autograd.grad((out * w).sum(), list(emb.parameters()))
    keep = ids != 3
    g_keep = torch.autograd.grad((emb(ids[keep]) * w[keep]).sum(), list(emb.parameters()))
    for a, b in zip(g_all, g_keep):
        torch.testing.assert_close(a, b)  # padding positions contribute nothing
    assert torch.all(emb.to_embedding().weight[3] == 0)
    assert TTEmbedding(40, 6, num_cores=2, padding_idx=-1).padding_idx == 39


@pytest.mark.parametrize("num_cores", [2, 3, 4])
def test_from_embedding_full_rank_is_exact_with_padding(num_cores):
    ref = nn.Embedding(90, 8, padding_idx=0, dtype=torch.float64)  # 90 rows, row modes may pad
    emb = TTEmbedding.from_embedding(ref, max_rank=10**6, num_cores=num_cores)
    assert emb.padding_idx == 0
    ids = torch.arange(90)
    torch.testing.assert_close(emb(ids), ref(ids), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(emb.to_embedding().weight, ref.weight, rtol=1e-10, atol=1e-10)


def test_default_init_std_is_one_over_sqrt_dim():
    """Documented choice (layers/embedding.py): table entries have std 1/sqrt(embedding_dim)."""
    torch.manual_seed(0)
    stds = [TTEmbedding(4096, 64, num_cores=3, max_rank=8).table().std().item() for _ in range(8)]
    assert abs(sum(stds) / len(stds) * 8 - 1) < 0.1
    ref_like = TTEmbedding(512, 16, num_cores=2, max_rank=8, init_std=1.0).table().std().item()
    assert 0.7 < ref_like < 1.3


def test_bad_input_names_the_parameter():
    cases = [
        ({"row_modes": [10, 10], "col_modes": [4, 3]}, r"row_modes=\[10, 10\] has product 100 < 101"),
        ({"row_modes": [11, 10], "col_modes": [4, 4]}, r"col_modes=\[4, 4\] has product 16, which differs from the dimension 12"),
        ({"row_modes": [11, 10], "col_modes": [2, 2, 3]}, r"must have the same number of cores"),
        ({"num_cores": 2, "ranks": [1, 0, 1]}, r"ranks\[1\] must be an int >= 1 \(rank\), got 0"),
        ({"num_cores": 2, "max_rank": 0}, r"max_rank must be an int >= 1, got 0"),
        ({"tau": 0}, r"tau must be a number > 0 \(the gate threshold\), got 0"),
        ({"padding_idx": 101}, r"padding_idx must be within \[-101, 101\), got 101"),
        ({"num_cores": 1}, r"num_cores must be an int >= 2, got 1"),
        ({"row_modes": [101], "col_modes": [12]}, r"a TTM embedding needs at least 2 cores, got row_modes=\[101\]"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            TTEmbedding(101, 12, **kw)
    with pytest.raises(ValueError, match=r"ids must be int64 or int32 token ids, got dtype torch.float32"):
        TTEmbedding(101, 12, num_cores=2)(torch.zeros(3))


def test_from_dense_and_to_dense_round_trip():
    E = torch.randn(30, 6, dtype=torch.float64)
    emb = TTEmbedding.from_dense(E, max_rank=10**6, num_cores=2)
    torch.testing.assert_close(emb.to_dense(), E, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match=r"table must be 2-D .* got shape \(30,\)"):
        TTEmbedding.from_dense(E[:, 0], max_rank=4)
