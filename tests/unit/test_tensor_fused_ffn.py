"""``tensor.fused_ffn.lowrank_gelu`` and the TT FFN that uses it, against the plain ops and the densified layers.

The fused op must equal ``gelu(h R + b) L`` forward and backward in every row blocking, keep no (T, F)
tensor for backward (measured with saved-tensor hooks), and compute what the plain ops do under autocast.
``kernels.dispatch.tt_ffn`` must give the same FFN on both of its paths, and the six-encoder-like model the
same loss and gradients with the fused FFN on and off. The CUDA cases need a GPU (``launch/gpu_check.sh``'s
kernel-tests run this file).
"""

import pytest
import torch
import torch.nn.functional as F
from accuracy_testlib import bf16_error_vs_torch
from autograd_testlib import saved_storages

from comera_dist.kernels import dispatch
from comera_dist.layers import TTLinear
from comera_dist.tensor import contract
from comera_dist.tensor.fused_ffn import lowrank_gelu

ON_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])


def _operands(T=37, r_in=5, F_=24, r_out=3, dtype=torch.float32, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, r_in, generator=g, dtype=dtype)
    R = torch.randn(r_in, F_, generator=g, dtype=dtype) / r_in ** 0.5
    b = torch.randn(F_, generator=g, dtype=dtype) if bias else None
    L = torch.randn(F_, r_out, generator=g, dtype=dtype) / F_ ** 0.5
    return h, R, b, L


def _plain(h, R, b, L):
    return F.gelu(h @ R if b is None else torch.addmm(b, h, R)) @ L


def _run(fn, operands, grad):
    leaves = [None if t is None else t.clone().requires_grad_() for t in operands]
    y = fn(*leaves)
    y.backward(grad)
    return [y] + [None if t is None else t.grad for t in leaves]


@pytest.mark.parametrize("rows", [None, 1, 8, 37, 100])
@pytest.mark.parametrize("bias", [True, False])
def test_lowrank_gelu_passes_gradcheck_in_fp64(rows, bias):
    h, R, b, L = (None if t is None else t.requires_grad_() for t in _operands(dtype=torch.float64, bias=bias))
    fn = (lambda h, R, b, L: lowrank_gelu(h, R, b, L, rows)) if bias else (lambda h, R, L: lowrank_gelu(h, R, None, L, rows))
    assert torch.autograd.gradcheck(fn, (h, R, b, L) if bias else (h, R, L))


@pytest.mark.parametrize("rows", [None, 4, 10, 64])
def test_lowrank_gelu_equals_the_plain_ops_forward_and_backward_in_fp32(rows):
    ops = _operands(T=64, F_=96, r_in=8, r_out=6)
    grad = torch.randn(64, 6, generator=torch.Generator().manual_seed(9))
    fused = _run(lambda h, R, b, L: lowrank_gelu(h, R, b, L, rows), ops, grad)
    plain = _run(_plain, ops, grad)
    for a, p in zip(fused, plain):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, p, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [None, 4])
def test_lowrank_gelu_in_bf16_is_as_close_to_fp64_as_the_plain_bf16_ops(rows):
    """The blocks' bf16 partial gradients are summed in fp32, so blocking costs no accuracy: the output and each
    gradient at most 2x as far from the fp64 result as the plain ops in bf16 are (``bf16_error_vs_torch``,
    FlashAttention's rule). Summed in bf16, 64 blocks of 4 rows put R's gradient 6x as far."""
    ops = _operands(T=256, F_=192, r_in=16, r_out=16, seed=3)
    bf16_error_vs_torch(lambda h, R, b, L: lowrank_gelu(h, R, b, L, rows), _plain, list(ops))


@pytest.mark.parametrize("h_dtype", [torch.float32, torch.bfloat16])
def test_lowrank_gelu_under_autocast_computes_what_the_plain_ops_do(h_dtype):
    h0, R0, b0, L0 = _operands(T=32, F_=48, r_in=8, r_out=4, seed=5)
    h0 = h0.to(h_dtype)
    res = []
    for fused in (True, False):
        h, R, b, L = (t.clone().requires_grad_() for t in (h0, R0, b0, L0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = lowrank_gelu(h, R, b, L) if fused else _plain(h, R, b, L)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()
        assert (h.grad.dtype, R.grad.dtype, b.grad.dtype, L.grad.dtype) == (h_dtype, *[torch.float32] * 3)
        res.append((y, h.grad, R.grad, b.grad, L.grad))
    for a, p in zip(*res):
        torch.testing.assert_close(a, p)


@pytest.mark.parametrize("rows", [None, 16])
def test_lowrank_gelu_keeps_no_wide_tensor(rows):
    h, R, b, L = (t.requires_grad_() for t in _operands(T=128, F_=256, r_in=8, r_out=8))
    _, fused = saved_storages(lambda: lowrank_gelu(h, R, b, L, rows))
    _, plain = saved_storages(lambda: _plain(h, R, b, L))
    leaves = {t.untyped_storage().data_ptr() for t in (h, R, b, L)}
    assert sum(n for k, n in fused.items() if k not in leaves) == 0  # h and the factors only
    assert sum(n for k, n in plain.items() if k not in leaves) >= 2 * 128 * 256 * 4  # u and gelu(u)


@pytest.mark.parametrize("rows", [None, 4])
def test_lowrank_gelu_takes_no_tokens(rows):
    h, R, b, L = (t.requires_grad_() for t in _operands(T=0))
    y = lowrank_gelu(h, R, b, L, rows)
    assert y.shape == (0, 3)
    y.sum().backward()
    assert h.grad.shape == (0, 5) and R.grad.abs().sum() == 0 and L.grad.abs().sum() == 0


def test_lowrank_gelu_names_bad_input():
    h, R, b, L = _operands()
    with pytest.raises(ValueError, match=r"h \(T, r_in\), R \(r_in, F\) and L \(F, r_out\).*\(37, 5\), \(5, 24\) and \(23, 3\)"):
        lowrank_gelu(h, R, b, L[:23])
    with pytest.raises(ValueError, match=r"bias must have shape \(24,\), got \(3,\)"):
        lowrank_gelu(h, R, b[:3], L)
    with pytest.raises(ValueError, match="rows must be >= 1 or None, got 0"):
        lowrank_gelu(h, R, b, L, 0)


def test_lowrank_gelu_compiles_fullgraph_in_blocks():
    ops = _operands(T=40, F_=32)
    grad = torch.randn(40, 3)
    fn = torch.compile(lambda h, R, b, L: lowrank_gelu(h, R, b, L, 16), fullgraph=True, backend="aot_eager")
    for a, p in zip(_run(fn, ops, grad), _run(_plain, ops, grad)):
        torch.testing.assert_close(a, p, rtol=1e-5, atol=1e-5)


def _tt_ffn_layers(seed=6):
    torch.manual_seed(seed)
    inp, out = TTLinear(48, 96, num_cores=4, max_rank=6), TTLinear(96, 48, num_cores=4, max_rank=6)
    with torch.no_grad():
        for layer in (inp, out):
            layer.gate.uniform_(0.0, 1.0)  # some bonds masked
            layer.bias.normal_()
    return inp, out


def test_tt_ffn_lr_equals_the_two_layers_and_the_densified_matrices():
    inp, out = _tt_ffn_layers()
    x = torch.randn(20, 48)
    fi, fo = inp._halves(inp.core, inp.gate), out._halves(out.core, out.gate)
    y = contract.tt_ffn_lr(x, (*fi, inp.bias), (*fo, out.bias), rows=6)
    torch.testing.assert_close(y, contract.tt_linear_lr_gelu(contract.tt_linear_lr(x, *fi, inp.bias), *fo, out.bias),
                               rtol=1e-5, atol=1e-6)
    dense = F.gelu(x @ inp.to_dense() + inp.bias) @ out.to_dense() + out.bias  # the TT formats densified
    torch.testing.assert_close(y, dense, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("rows", ["all", "5"])
def test_dispatch_tt_ffn_fused_equals_its_unfused_path(monkeypatch, rows):
    inp, out = _tt_ffn_layers(seed=7)
    x0 = torch.randn(2, 9, 48)
    res = []
    for setting in (rows, "off"):
        monkeypatch.setenv("COMERA_FFN_ROWS", setting)
        inp.zero_grad(), out.zero_grad()
        x = x0.clone().requires_grad_()
        y = dispatch.tt_ffn(x, inp._halves(inp.core, inp.gate), inp.bias, out._halves(out.core, out.gate), out.bias)
        assert y.shape == (2, 9, 48)
        y.square().sum().backward()
        res.append((y, x.grad, inp.core.grad, inp.gate.grad, inp.bias.grad, out.core.grad, out.gate.grad,
                    out.bias.grad))
    for a, p in zip(*res):
        torch.testing.assert_close(a, p, rtol=1e-5, atol=1e-6)


def test_ffn_rows_reads_its_setting(monkeypatch):
    t = torch.empty(4096, 768)
    monkeypatch.delenv("COMERA_FFN_ROWS", raising=False)
    assert dispatch.ffn_rows(t, 3072) == 128  # the CPU: blocks of at most FFN_BLOCK_ELEMENTS, a power of two rows
    assert dispatch.ffn_rows(t, 1024) == 512 and dispatch.ffn_rows(t, 10**9) == 8  # never fewer than 8 rows
    with dispatch.static_shapes():  # the GPU's step emulated on the CPU: one block, as on a GPU
        assert dispatch.ffn_rows(t, 3072) == 4096
    for raw, rows in (("off", 0), ("all", 4096), ("64", 64), (" ALL ", 4096)):
        monkeypatch.setenv("COMERA_FFN_ROWS", raw)
        assert dispatch.ffn_rows(t, 3072) == rows
    for bad in ("0", "-3", "many"):
        monkeypatch.setenv("COMERA_FFN_ROWS", bad)
        with pytest.raises(ValueError, match="COMERA_FFN_ROWS must be auto, off, all or a positive row count"):
            dispatch.ffn_rows(t, 3072)


@pytest.mark.parametrize("arch", ["six_encoder_cls", "bert_mlm"])
def test_models_give_the_same_loss_and_gradients_with_the_fused_ffn_on_and_off(monkeypatch, arch):
    """The FFN of every block through ``tt_ffn`` in blocks of 5 tokens (16 per batch: blocks of 5, 5, 5, 1)
    equals it through the unfused ops, in fp64, gates below tau included."""
    from comera_dist.compression.config import TensorizeConfig
    from comera_dist.compression.walk import tensorized_modules
    from comera_dist.models import build_model
    from comera_dist.models.config import ModelConfig

    extra = {"num_labels": 3} if arch == "six_encoder_cls" else {}
    cfg = ModelConfig(arch=arch, vocab_size=50, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                      max_positions=8, dropout=0.0, **extra)
    torch.manual_seed(0)
    model = build_model(cfg, TensorizeConfig(max_rank=3, embedding_max_rank=3)).double()
    with torch.no_grad():
        for _, layer in tensorized_modules(model):
            layer.gate.uniform_(0.5, 1.5)
            layer.gate[::3] = 0.005
    ids = torch.randint(0, 50, (2, 8))
    labels = torch.tensor([0, 2]) if arch == "six_encoder_cls" else ids
    calls = []
    real = dispatch.tt_ffn
    monkeypatch.setattr(dispatch, "tt_ffn", lambda *a: calls.append(1) or real(*a))
    results = []
    for rows in ("5", "off"):
        monkeypatch.setenv("COMERA_FFN_ROWS", rows)
        model.zero_grad()
        loss = model(ids, labels=labels)["loss"]
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert len(calls) == 2 * cfg.num_layers  # every block's FFN, each way
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
@pytest.mark.parametrize("dtype,autocast", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)],
                         ids=["fp32", "bf16", "autocast"])
def test_tt_ffn_default_equals_the_unfused_layers_on_the_device(monkeypatch, device, dtype, autocast):
    """The device's default blocking (one block on a GPU, 128 tokens on the CPU) against ``COMERA_FFN_ROWS=off``, at
    the six-encoder's FFN width, 300 tokens: outputs and gradients in each input's dtype."""
    g = torch.Generator().manual_seed(11)
    shapes = {"x": (300, 768), "L_in": (768, 32), "R_in": (32, 3072), "b_in": (3072,), "L_out": (3072, 32),
              "R_out": (32, 768), "b_out": (768,)}
    base = {k: (torch.randn(v, generator=g) / (v[0] ** 0.5 if len(v) == 2 else 1.0)).to(device, dtype)
            for k, v in shapes.items()}
    monkeypatch.delenv("COMERA_FFN_ROWS", raising=False)
    assert dispatch.ffn_rows(base["x"], 3072) == (300 if device == "cuda" else 128)
    res = []
    for setting in ("auto", "off"):
        monkeypatch.setenv("COMERA_FFN_ROWS", setting)
        t = {k: v.clone().requires_grad_() for k, v in base.items()}
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            y = dispatch.tt_ffn(t["x"], (t["L_in"], t["R_in"]), t["b_in"], (t["L_out"], t["R_out"]), t["b_out"])
        assert y.dtype == (torch.bfloat16 if autocast else dtype)
        y.float().square().sum().backward()
        assert all(t[k].grad.dtype == dtype for k in t)
        res.append([y] + [t[k].grad for k in shapes])
    if dtype == torch.float32 and not autocast:
        for a, p in zip(*res, strict=True):
            torch.testing.assert_close(a, p)
        return

    # bf16 compute: the fused op rounds differently (other GEMM splits, the blocks' sums), so it is held to the
    # rule every fast path is (``bf16_error_vs_torch``): at most 2x the unfused bf16 path's error against fp64
    def ffn(setting):
        def run(x, L_in, R_in, b_in, L_out, R_out, b_out):
            monkeypatch.setenv("COMERA_FFN_ROWS", setting)
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast and x.dtype != torch.float64):
                return dispatch.tt_ffn(x, (L_in, R_in), b_in, (L_out, R_out), b_out)
        return run

    bf16_error_vs_torch(ffn("auto"), ffn("off"), [base[k] for k in shapes])
