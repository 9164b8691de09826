"""``bench summary``'s page: each result's command (the one it recorded, else one rebuilt from every setting it
recorded, marked so), its own machine and cores, and bench comm's target against its own compression ratio.

A rebuilt command is checked by handing its arguments to the benchmark's own parser: what the benchmark would
run is what the JSON records."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import shlex
from pathlib import Path

import pytest

from comera_dist.bench import common, summary

BENCH_DIR = Path(summary.__file__).parent
H200 = {"platform": "Linux-gpu", "python": "3.12.3", "torch": "2.11.0+cu130", "cpu_count": 16, "torch_threads": 16,
        "cpu": "Intel(R) Xeon(R) Processor", "gpu": "NVIDIA H200"}
EPYC = {"platform": "Linux-cpu", "python": "3.11.7", "torch": "2.13.0+cpu", "cpu_count": 2, "torch_threads": 1,
        "cpu": "AMD EPYC"}


def _result(benchmark: str, config: dict, rows: list[dict] | None = None, metrics: dict | None = None,
            machine: dict | None = None) -> dict:
    return {"benchmark": benchmark, "machine": machine or EPYC, "config": config, "metrics": metrics or {"x": 1.0},
            "rows": rows or []}


# the device run of six-encoder as the H200's recompute step ran it, with CoMERA's rank padding off and a
# cuBLAS workspace set: every option the old fixed key list dropped
SIX_RECOMPUTE = _result("six-encoder", {
    "device": "NVIDIA H200", "steps": 10, "batch_sizes": [1], "smoke": False, "recompute": True,
    "modes": "eager; graph = ...; compiled = loss through torch.compile(backend='inductor'); metrics: best mode each",
    "modes_run": ["compiled-graph", "eager", "graph"], "kernel_time": {}, "rank_align": 1, "ffn_rows": "auto",
    "cublas_workspace_env": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "CUBLASLT_WORKSPACE_SIZE": None},
    "cublaslt_env": {"DISABLE_ADDMM_CUDA_LT": None, "TORCH_BLAS_PREFER_CUBLASLT": None}},
    rows=[{"contender": c, "mode": m, "dtype": "fp32", "batch": 1}
          for c, ms in (("comera", ("eager", "graph", "compiled-graph")), ("galore", ("eager",))) for m in ms],
    machine=H200)
OLD = {  # results from before bench_command, as the committed JSONs record them
    "six-encoder-recompute-cuda-h200": SIX_RECOMPUTE,
    "galore-recompute": _result("galore", {"steps": 5, "batch_size": 1, "smoke": False, "threads": 1,
                                           "recompute": True}),
    "layers-cpu": _result("layers", {"tokens": 4096, "reps": 7},
                          rows=[{"allocator": "default"}, {"allocator": "malloc_tuned"}]),
    "kernels-cuda-h200": _result("kernels", {"device": "NVIDIA H200", "tokens": [4096, 16384],
                                             "dtypes": ["bf16"], "reps": 10}, machine=H200),
    "comm": _result("comm", {"micro_batch": 4, "zero_stage": 2, "steps": 3, "warmup": 1, "world_size": 2}),
}
REBUILT = {
    "six-encoder-recompute-cuda-h200":
        "COMERA_RANK_ALIGN=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m comera_dist.bench six-encoder "
        "--json docs/bench/six-encoder-recompute-cuda-h200.json --steps 10 --device cuda "
        "--modes eager graph compiled-graph --dtypes fp32 --contenders comera galore --batch-sizes 1 --recompute",
    "galore-recompute": "python -m comera_dist.bench galore --json docs/bench/galore-recompute.json --steps 5 "
                        "--batch-size 1 --threads 1 --recompute",
    "layers-cpu": "python -m comera_dist.bench layers --json docs/bench/layers-cpu.json --steps 7 --batch-size 4096 "
                  "--malloc-tune",
    "kernels-cuda-h200": "python -m comera_dist.bench kernels --json docs/bench/kernels-cuda-h200.json --steps 10 "
                         "--tokens 4096 16384 --dtypes bfloat16",
    "comm": "python -m comera_dist.bench comm --json docs/bench/comm.json --steps 3 --batch-size 4 --zero-stage 2 "
            "--warmup 1",
}
# what each benchmark's own parser must make of the rebuilt arguments
PARSED = {
    "six-encoder-recompute-cuda-h200": {"device": "cuda", "steps": 10, "batch_sizes": [1], "recompute": True,
                                        "modes": ["eager", "graph", "compiled-graph"], "dtypes": ["fp32"],
                                        "contenders": ["comera", "galore"], "profile": False, "smoke": False},
    "galore-recompute": {"steps": 5, "batch_size": 1, "threads": 1, "recompute": True, "smoke": False},
    "layers-cpu": {"steps": 7, "batch_size": 4096, "malloc_tune": True},
    "kernels-cuda-h200": {"steps": 10, "tokens": [4096, 16384], "dtypes": ["bfloat16"], "allow_cpu": False},
    "comm": {"steps": 3, "batch_size": 4, "zero_stage": 2, "warmup": 1},
}


class _Parsed(Exception):
    """Raised in place of running the benchmark once its arguments are parsed."""


def _parse(benchmark: str, argv: list[str], monkeypatch) -> argparse.Namespace:
    """The namespace ``benchmark``'s own ``main`` parses from ``argv`` (it runs no further)."""
    real, got = argparse.ArgumentParser.parse_args, {}

    def parse_and_stop(self, args=None, namespace=None):
        got["ns"] = real(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    module = importlib.import_module(f"comera_dist.bench.{benchmark.replace('-', '_')}")
    with pytest.raises(_Parsed):
        module.main(argv)
    return got["ns"]


def test_write_result_records_the_exact_command_and_the_environment_that_changes_it(tmp_path, monkeypatch):
    for name in common.COMMAND_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("COMERA_RANK_ALIGN", "1")
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # not one that changes a benchmark
    out = tmp_path / "r.json"
    common.write_result(out, "six-encoder", {"m": 1.0}, [], {"steps": 2},
                        argv=["--steps", "2", "--set", "model.name=a b", "--json", str(out)])
    got = json.loads(out.read_text())["config"]
    assert got["bench_command"] == ("COMERA_RANK_ALIGN=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m comera_dist.bench "
                                    f"six-encoder --steps 2 --set 'model.name=a b' --json {out}")
    assert got["steps"] == 2


def test_every_benchmark_records_its_own_arguments():
    """Each ``write_result`` call in the benchmarks passes the ``argv`` its ``main`` parsed."""
    calls = []
    for path in sorted(BENCH_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "write_result":
                argv = next((k.value for k in node.keywords if k.arg == "argv"), None)
                calls.append((path.name, isinstance(argv, ast.Name) and argv.id == "argv"))
    assert len(calls) >= 12 and all(ok for _, ok in calls), calls


def test_the_page_prints_a_recorded_command_as_it_is(tmp_path):
    recorded = "OMP_NUM_THREADS=1 python -m comera_dist.bench ops --compiled --json docs/bench/ops-cpu.json"
    (tmp_path / "ops-cpu.json").write_text(json.dumps(_result("ops", {"bench_command": recorded, "batch_size": 2})))
    (tmp_path / "soak.json").write_text(json.dumps(_result("soak", {  # bench soak's record before bench_command
        "steps": 2000, "command": "python -m comera_dist.bench soak --steps 2000 --checkpoint-every 100"})))
    text = summary.render(tmp_path, tmp_path / "out.md")
    assert f"| ops-cpu | `{recorded}` |" in text
    assert "| soak | `python -m comera_dist.bench soak --steps 2000 --checkpoint-every 100` |" in text


@pytest.mark.parametrize("stem", sorted(OLD))
def test_an_older_result_gets_every_recorded_setting_back_marked_as_rebuilt(stem, tmp_path, monkeypatch):
    result = OLD[stem]
    text, recorded = summary.command(result["benchmark"], result, stem)
    assert (text, recorded) == (REBUILT[stem], False)
    (tmp_path / f"{stem}.json").write_text(json.dumps(result))
    assert f"| {stem} | `{text}` (rebuilt from the recorded settings) |" in summary.render(tmp_path, tmp_path / "o.md")
    words = shlex.split(text)
    start = words.index("python")
    assert words[start:start + 4] == ["python", "-m", "comera_dist.bench", result["benchmark"]]
    ns = _parse(result["benchmark"], words[start + 4:], monkeypatch)
    assert {k: getattr(ns, k) for k in PARSED[stem]} == PARSED[stem]


def test_each_section_names_its_own_machine_and_cores(tmp_path):
    load = {"load_avg_start": [0.9, 0.5, 0.2], "load_avg_end": [1.0, 0.5, 0.2]}
    (tmp_path / "galore.json").write_text(json.dumps(_result("galore", {"steps": 5} | load)))
    (tmp_path / "six-encoder-cuda-h200.json").write_text(json.dumps(_result("six-encoder", dict(load),
                                                                           machine=H200)))
    text = summary.render(tmp_path, tmp_path / "out.md")
    gpu = "GPU NVIDIA H200; Intel(R) Xeon(R) Processor, 16 cores; torch 2.11.0+cu130, Python 3.12.3"
    cpu = "CPU only; AMD EPYC, 2 cores; torch 2.13.0+cpu, Python 3.11.7"
    machines = text.split("## Machine")[1].split("| benchmark | command |")[0]
    assert f"| {cpu} | Linux-cpu | galore |" in machines and f"| {gpu} | Linux-gpu | six-encoder-cuda-h200 |" in machines
    h200 = text.split("## six-encoder-cuda-h200")[1]
    assert "1-min load average at start / end: 0.9 / 1.0 (16 cores)." in h200 and f"Machine: {gpu}." in h200
    epyc = text.split("## galore")[1].split("## six-encoder")[0]
    assert "(2 cores)." in epyc and f"Machine: {cpu}." in epyc


@pytest.mark.parametrize(("ratio", "status"), [(3.004, "MISSED (1.003x short)"), (3.5, "met")])
def test_comm_is_judged_against_its_own_compression_ratio(ratio, status, tmp_path):
    metrics = {"comm_bytes_ratio_dense_over_comera": ratio, "compression_ratio": 3.013}
    (tmp_path / "comm.json").write_text(json.dumps(_result("comm", {"steps": 3}, metrics=metrics)))
    text = summary.render(tmp_path, tmp_path / "out.md")
    assert (f"| `comm_bytes_ratio_dense_over_comera` | bytes communicated per step, dense / CoMERA, against the "
            f"whole-model compression ratio | >= `compression_ratio` = 3.013 | {ratio:g} | {status} |") in text
