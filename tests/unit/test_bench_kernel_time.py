"""``bench.kernel_time``: one step's kernels timed and summed by kind (``bench six-encoder --profile``).

The CUDA case needs a GPU (``launch/gpu_check.sh``'s kernel-tests run this file); on the CPU aten ops
stand in for kernels."""

import pytest
import torch

from comera_dist.bench.kernel_time import kernel_time, kind_of

ON_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (CUPTI kernel records)")])


@pytest.mark.parametrize(("name", "kind"), [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
    ("aten::mm", "gemm"),
    ("nvjet_sm90_tst_192x128_64x5_1x2_h_bz_coopB_NNT", "gemm"),  # cuBLAS on an H200, bf16
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64", "attention"),
    ("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "attention"),
    ("fmha_cutlassB_f32_aligned_64x64_k64_sm80", "attention"),  # a GEMM's name inside: attention first
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "softmax"),
    ("void at::native::vectorized_layer_norm_kernel<float, float>", "norm"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("triton_per_fused_add_native_layer_norm_0", "triton"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, GeluCUDAKernelImpl>", "other"),
])
def test_kinds_by_name(name, kind):
    assert kind_of(name) == kind


@pytest.mark.parametrize("device", ["cpu", ON_CUDA])
def test_a_steps_kernels_are_timed_and_summed_by_kind(device):
    a = torch.randn(256, 256, device=device)
    b = torch.randn(256, 256, device=device)

    def step():
        with torch.profiler.record_function("a_user_range"):  # spans the kernels on CUDA: not one itself
            for _ in range(3):
                torch.softmax(a @ b, dim=-1)

    got = kernel_time(step, torch.device(device))
    assert got["device_ms"] > 0 and got["kernels"] >= 6, got  # 3 products, 3 softmaxes at least
    assert got["by_kind_ms"]["gemm"] > 0 and got["by_kind_ms"]["softmax"] > 0, got
    assert sum(got["by_kind_ms"].values()) == pytest.approx(got["device_ms"])
    top = {t["name"]: t for t in got["top"]}
    assert "a_user_range" not in top, top
    # one GEMM kernel per product, or two where cuBLAS splits K (an H200 does at 256^3: gemm + its reduce)
    gemm_calls = sum(t["calls"] for name, t in top.items() if kind_of(name) == "gemm")
    assert gemm_calls in (3, 6), top


def test_a_step_without_kernels_is_refused():
    with pytest.raises(RuntimeError, match="no kernel"):
        kernel_time(lambda: None, torch.device("cpu"))
