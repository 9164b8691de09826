"""``launch/gpu_check.sh --cpu-smoke``: the GPU acceptance script runs end to end on CPU at tiny sizes.

The same steps as on a GPU (wheel install check, kernel tests, bf16 pretraining at ZeRO 1/2/3 with
the late stage, a physical prune and a mid-run checkpoint, a resumed run that must reproduce the
first run's losses step for step, the benchmarks and the trainer-rate comparison), so CI keeps the
script itself working for the sessions that are lent a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _cpu_smoke(tmp_path: Path, timeout: int, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """``launch/gpu_check.sh OUT --cpu-smoke`` with its runs under ``tmp_path``, no wheels, and ``env``."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "TRITON_INTERPRET")} | {
        "COMERA_CHECK_WORK": str(tmp_path / "work"), "WHEELS": str(tmp_path / "no-wheels")} | env
    p = subprocess.run(["launch/gpu_check.sh", str(out), "--cpu-smoke"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=timeout, check=False)
    return p, out


@pytest.mark.slow
def test_gpu_check_cpu_smoke(tmp_path):
    p, out = _cpu_smoke(tmp_path, 900)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    logs = {f.name: f.read_text(errors="replace")[-3000:] for f in (out / "logs").glob("*.log")} if out.exists() else {}
    failed = [s["step"] for s in summary.get("steps", []) if s["rc"] != 0]
    assert p.returncode == 0 and summary.get("ok"), (p.stdout[-3000:], p.stderr[-3000:],
                                                       {k: v for k, v in logs.items() if any(f in k for f in failed)})
    assert [s["step"] for s in summary["steps"]] == ["env", "kernel-tests", "pretrain-z1", "pretrain-z2",
                                                     "pretrain-z3", "pretrain-z0-graphs",
                                                     "pretrain-recompute-graphs", "bench-kernels",
                                                     "bench-six-encoder",
                                                     "bench-six-encoder-ws4", "bench-six-encoder-compiled",
                                                     "bench-six-encoder-recompute",
                                                     "bench-six-encoder-recompute-factors", "bench-six-encoder-align1",
                                                     "bench-six-encoder-nolt", "bench-six-encoder-ffn-off",
                                                     "bench-six-encoder-peaks",
                                                     "trainer-rate", "trainer-rate-unpacked", "trainer-rate-nocheck",
                                                     "trainer-rate-lean", "trainer-rate-graphs",
                                                     "trainer-rate-graphs-opt"]
    for name in ("z1", "z2", "z3", "z0-graphs", "recompute-graphs"):
        log = (out / "logs" / f"pretrain-{name}.log").read_text()
        check = json.loads(next(line for line in log.splitlines() if line.startswith('{"resume_step"')))
        assert check["problems"] == [] and check["compared_steps"] == 3 and check["max_rel_diff"] == 0.0
        a = (out / "logs" / f"pretrain-{name}-a.log").read_text()
        assert "physical prune, engine rebuilt" in a and "stage 1" in a  # the late stage ran
    z0 = (out / "logs" / "pretrain-z0-graphs-a.log").read_text()  # compiled, and again after each prune
    assert z0.count("torch.compile (aot_eager, mode reduce-overhead): engine compiled = True") >= 2, z0[-2000:]
    recompute_log = (out / "logs" / "pretrain-recompute-graphs-a.log").read_text()
    assert recompute_log.count("torch.compile (aot_eager, mode reduce-overhead): engine compiled = True") >= 2
    ran = (tmp_path / "work" / "recompute-graphs-a" / "checkpoints" / "step00000006" / "config.yaml").read_text()
    assert "activation_checkpointing: true" in ran and "dropout: 0.1" in ran
    assert json.loads((out / "kernels.json").read_text())["benchmark"] == "kernels"
    assert json.loads((out / "six-encoder.json").read_text())["benchmark"] == "six-encoder"
    ws = json.loads((out / "six-encoder-ws4.json").read_text())  # every contender under a 4 MiB workspace
    assert ws["config"]["cublas_workspace_env"] == {"CUBLAS_WORKSPACE_CONFIG": ":4096:1",
                                                    "CUBLASLT_WORKSPACE_SIZE": "4096"}
    assert summary["metrics"]["six-encoder-ws4"]["memory_ratio_galore_over_comera_b1_cpu"] > 0
    recompute = json.loads((out / "six-encoder-recompute.json").read_text())  # every block recomputed in backward
    assert recompute["config"]["recompute"] is True
    assert {(r["contender"], r["mode"]) for r in recompute["rows"] if "error" not in r} == {
        ("comera", "eager"), ("comera", "compiled"), ("galore", "eager")}
    assert summary["metrics"]["six-encoder-recompute"]["memory_ratio_galore_over_comera_b1_cpu_recompute"] > 0
    factors = json.loads((out / "six-encoder-recompute-factors.json").read_text())  # blocks remake their factors
    assert factors["config"]["recompute_factors"] is True
    assert summary["metrics"]["six-encoder-recompute-factors"][
        "memory_ratio_galore_over_comera_b1_cpu_recompute_factors"] > 0
    align1 = json.loads((out / "six-encoder-align1.json").read_text())  # the factors at their own middle rank
    assert align1["config"]["rank_align"] == 1 and ws["config"]["rank_align"] == 8
    assert summary["metrics"]["six-encoder-align1"]["speedup_vs_dense_b1_cpu_fp32"] > 0
    nolt = json.loads((out / "six-encoder-nolt.json").read_text())  # no product on cuBLASLt (a no-op on the CPU)
    assert nolt["config"]["cublaslt_env"] == {"DISABLE_ADDMM_CUDA_LT": "1", "TORCH_BLAS_PREFER_CUBLASLT": "0"}
    assert ws["config"]["cublaslt_env"] == {"DISABLE_ADDMM_CUDA_LT": None, "TORCH_BLAS_PREFER_CUBLASLT": None}
    assert all(r["workspace_MiB"] == 0 for r in nolt["rows"])  # the CPU has no cuBLAS workspaces
    ffn_off = json.loads((out / "six-encoder-ffn-off.json").read_text())  # CoMERA's TT FFN unfused
    assert ffn_off["config"]["ffn_rows"] == "off" and ws["config"]["ffn_rows"] == "auto"
    assert summary["metrics"]["six-encoder-ffn-off"]["speedup_vs_dense_b1_cpu_fp32"] > 0
    peaks = summary["peak_allocations"]  # on the CPU torch.profiler's allocations (bench.peak_allocations.cpu_trace)
    assert set(peaks) == {f"six-encoder-{s} {c} eager fp32 b1" for s in ("peaks", "recompute-factors")
                          for c in ("comera", "galore")}, peaks
    for name, p_ in peaks.items():
        assert p_["recorded_by"] == "torch.profiler" and p_["transient_peak_MiB"] > 0 and p_["rows"], (name, p_)
    assert "six-encoder-peaks comera eager fp32 b1 peak allocations: " in p.stdout
    assert "MiB allocated in the step at its peak (torch.profiler): comera_dist/" in p.stdout
    compiled = summary["metrics"]["six-encoder-compiled"]  # the bf16 candidate: the loss compiled, both models
    assert compiled["speedup_vs_dense_compiled_b1_cpu_bf16"] > 0
    # --profile: each row's kernels by kind, in the summary and its printout
    profiled = {k: v for k, v in summary["kernel_time"].items() if k.startswith("six-encoder-compiled ")}
    assert set(profiled) == {f"six-encoder-compiled {c} {m} bf16 b1" for c in ("dense", "comera")
                             for m in ("eager", "compiled")}, summary["kernel_time"].keys()
    assert all(k["device_ms"] > 0 for k in profiled.values())
    assert "six-encoder-compiled comera compiled bf16 b1: kernels " in p.stdout
    rate = json.loads((out / "trainer-rate.json").read_text())["metrics"]
    # the summary reports the trainer's and the bench's step rates side by side
    assert summary["metrics"]["trainer-rate"] == rate and rate["trainer_tokens_per_s"] > 0
    assert f"trainer_rate_over_bench {rate['trainer_rate_over_bench']:.4g}" in p.stdout
    unpacked = json.loads((out / "trainer-rate-unpacked.json").read_text())
    assert "deepspeed.pack_vectors=false" in unpacked["config"]["overrides"]
    assert summary["metrics"]["trainer-rate-unpacked"]["trainer_tokens_per_s"] > 0
    nocheck = json.loads((out / "trainer-rate-nocheck.json").read_text())
    assert {"deepspeed.precision=bf16", "deepspeed.bf16_overflow_check=false"} <= set(nocheck["config"]["overrides"])
    assert summary["metrics"]["trainer-rate-nocheck"]["trainer_tokens_per_s"] > 0
    lean = json.loads((out / "trainer-rate-lean.json").read_text())
    assert {"deepspeed.bf16_overflow_check=false", "deepspeed.contiguous_gradients=false"} <= set(lean["config"]["overrides"])
    assert summary["metrics"]["trainer-rate-lean"]["trainer_tokens_per_s"] > 0
    graphs = (out / "logs" / "trainer-rate-graphs.log").read_text()
    assert "torch.compile (aot_eager, mode reduce-overhead): engine compiled = True" in graphs  # trainer and session
    assert summary["metrics"]["trainer-rate-graphs"]["trainer_tokens_per_s"] > 0
    opt = (out / "logs" / "trainer-rate-graphs-opt.log").read_text()
    assert "torch.compile (aot_eager): optimizer step of DeepSpeedZeroOptimizer compiled" in opt
    assert summary["metrics"]["trainer-rate-graphs-opt"]["trainer_tokens_per_s"] > 0
    opt_counted = json.loads((out / "trainer-rate-graphs-opt.json").read_text())["config"]["compile_counters"]
    assert opt_counted["stats"]["unique_graphs"] > 3, opt_counted  # the model's 3 and the optimizer step's
    counted = json.loads((out / "trainer-rate-graphs.json").read_text())["config"]["compile_counters"]
    # one graph per compiled forward: the trainer's training and evaluation calls, the session's (the
    # packing's forward hooks made 7: each hook traced as a frame of its own)
    assert counted["graph_break"] == {} and counted["stats"]["unique_graphs"] == 3, counted
    # the compiled session step leaves about a third of the eager one's host ops around its graphs
    # (smoke: 413 against 1,183 at bdefc80, 260 against 1,120 at 8a4ea08); a compile fallen back to eager
    # would leave them all
    host = {name: summary["metrics"][name]["host_ops_per_step_session"] for name in ("trainer-rate", "trainer-rate-graphs")}
    assert 0 < host["trainer-rate-graphs"] < 0.6 * host["trainer-rate"], host
    # the host time by phase: DeepSpeed's forward, backward and step inside the session step, each a part of it
    phases = summary["host_phases_ms"]["trainer-rate session step"]
    assert {"step", "deepspeed forward", "deepspeed backward", "deepspeed step"} <= set(phases), phases
    assert all(0 < phases[k] < phases["step"] for k in ("deepspeed forward", "deepspeed backward", "deepspeed step"))
    assert not any(k.startswith("deepspeed") for k in summary["host_phases_ms"]["trainer-rate bench step"])
    assert "trainer-rate session step host ms/step (cProfile): step " in p.stdout
    # the trainer's loop: the session step and what the trainer adds around it, each a part of the iteration
    loop = summary["host_phases_ms"]["trainer-rate trainer loop"]
    assert {"step", "batch fetch", "device synchronize", "step metrics", "metrics log"} <= set(loop), loop
    assert "trainer-rate trainer loop host ms/step (cProfile): step " in p.stdout
    assert summary["env"]["mode"] == "cpu-smoke"


@pytest.mark.slow
def test_steps_run_side_by_side_on_cpu_are_summarised_in_the_scripts_order(tmp_path):
    """The CPU smoke runs two steps at a time: a short step listed after a long one finishes first, and
    results.tsv and the summary still list them in the script's order."""
    p, out = _cpu_smoke(tmp_path, 300, COMERA_CHECK_ONLY="bench-six-encoder-compiled bench-six-encoder-align1")
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    # the short step reported first: the two ran side by side
    assert p.stdout.index("-> bench-six-encoder-align1: rc 0") < p.stdout.index("-> bench-six-encoder-compiled: rc 0"), p.stdout
    steps = [line.split("\t")[0] for line in (out / "results.tsv").read_text().splitlines()]
    assert steps == ["bench-six-encoder-compiled", "bench-six-encoder-align1"]
    summary = json.loads((out / "summary.json").read_text())
    assert [s["step"] for s in summary["steps"]] == steps
