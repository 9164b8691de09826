"""``bench six-encoder --device --modes ... compiled``: the compiled step computes the eager step, and the
mode selection says what runs where.

The compiled modes are inductor on a GPU; here the ``aot_eager`` backend traces forward and backward the
same way (Dynamo, AOTAutograd, fullgraph) without code generation, which takes minutes on a CPU.
"""

from __future__ import annotations

import json

import pytest
import torch
from bench_cases import no_dropout
from torch._dynamo.testing import CompileCounterWithBackend

from comera_dist.bench import six_encoder
from comera_dist.bench.six_encoder_device import compile_loss, modes


def _step(c: six_encoder.Contender, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = c.loss(batch)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in c.model.named_parameters() if p.grad is not None}
    c.optimizer.step()
    c.optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.mark.parametrize("name", ["comera", "dense"])
def test_compiled_loss_is_one_graph_and_steps_like_eager(name):
    eager = no_dropout(six_encoder.make_contender(name, smoke=True))
    compiled = no_dropout(six_encoder.make_contender(name, smoke=True))
    counter = CompileCounterWithBackend("aot_eager")
    compile_loss(compiled, counter)
    for seed in range(3):  # new data each step, the same (static) shapes: compiled once
        batch = six_encoder.random_batch(eager.model, 2, smoke=True, seed=seed)
        want, want_grads = _step(eager, batch)
        got, got_grads = _step(compiled, batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert got_grads.keys() == want_grads.keys()
        for n, g in want_grads.items():
            torch.testing.assert_close(got_grads[n], g, rtol=1e-4, atol=1e-6, msg=f"step {seed}: {n}.grad")
    assert counter.frame_count == 1, f"{counter.frame_count} graphs: the loss was not compiled whole, or recompiled"
    for p, q in zip(eager.model.parameters(), compiled.model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)


def test_modes_keep_what_each_contender_and_device_can_run():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert modes("comera", cpu) == ("eager",)
    assert modes("comera", cuda) == ("eager", "graph")
    everything = ("eager", "graph", "compiled", "compiled-graph")
    assert modes("dense", cpu, everything) == ("eager", "compiled")  # graphs need CUDA
    assert modes("dense", cuda, everything) == everything
    assert modes("galore", cuda, everything) == ("eager",)  # GaLore's projections are host work
    assert modes("galore", cuda, ("compiled-graph",)) == ()
    with pytest.raises(ValueError, match="unknown mode"):
        modes("comera", cuda, ("graphs",))


def test_device_run_records_compiled_rows_and_their_ratio(tmp_path):
    out = tmp_path / "se.json"
    assert six_encoder.main(["--smoke", "--device", "cpu", "--modes", "eager", "compiled", "--dtypes", "bf16",
                             "--contenders", "dense", "comera", "--compile-backend", "aot_eager",
                             "--batch-sizes", "2", "--steps", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    rows = {(row["contender"], row["mode"], row["dtype"], row["batch"]): row for row in r["rows"]}
    assert rows.keys() == {(c, m, "bf16", 2) for c in ("dense", "comera") for m in ("eager", "compiled")}
    assert all("error" not in row and row["step_s"] > 0 for row in rows.values())
    m = r["metrics"]
    assert m["speedup_vs_dense_compiled_b2_cpu_bf16"] == pytest.approx(
        rows["dense", "compiled", "bf16", 2]["step_s"] / rows["comera", "compiled", "bf16", 2]["step_s"])
    assert r["config"]["modes_run"] == ["compiled", "eager"]


def test_inductor_compiled_rows_count_their_graphs_kernels(tmp_path):
    out = tmp_path / "se.json"
    assert six_encoder.main(["--smoke", "--device", "cpu", "--modes", "eager", "compiled", "--dtypes", "bf16",
                             "--contenders", "comera", "--batch-sizes", "2", "--steps", "1",
                             "--json", str(out)]) == 0  # inductor, the default backend
    rows = {row["mode"]: row for row in json.loads(out.read_text())["rows"]}
    compiled = rows["compiled"]
    assert "graph_kernels_error" not in compiled, compiled
    assert compiled["graph_kernels"] == compiled["generated_kernels"] + compiled["extern_kernels"]
    assert compiled["generated_kernels"] > 0 and compiled["extern_kernels"] > 0, compiled
    assert "graph_kernels" not in rows["eager"]  # an eager step has no graph to count


def test_recompute_run_names_its_metrics_apart_and_keeps_less_at_batch_1(tmp_path):
    """``--recompute``: every contender recomputes its blocks; on the CPU the peak is the profiler's, which
    sees the recomputed activations, and CoMERA's batch-1 peak is below the plain run's; with
    ``--recompute-factors`` (each block remaking its TT factors too) lower still. GaLore has no factors."""
    peaks = {}
    for flag, suffix in (([], ""), (["--recompute"], "_recompute"), (["--recompute-factors"], "_recompute_factors")):
        out = tmp_path / f"se{suffix}.json"
        assert six_encoder.main(["--smoke", "--device", "cpu", "--dtypes", "fp32", "--contenders", "comera",
                                 "galore", "--batch-sizes", "1", "--steps", "1", "--json", str(out), *flag]) == 0
        r = json.loads(out.read_text())
        assert r["config"]["recompute"] is bool(flag)
        assert r["config"]["recompute_factors"] is (suffix == "_recompute_factors")
        assert set(r["metrics"]) == {f"speedup_vs_galore_b1_cpu{suffix}", f"memory_ratio_galore_over_comera_b1_cpu{suffix}"}
        assert f"memory_ratio_galore_over_comera_b1_cpu{suffix}" in r["config"]["target"]
        peaks[suffix] = {row["contender"]: row["peak_MiB"] for row in r["rows"]}
    assert peaks["_recompute_factors"]["comera"] < peaks["_recompute"]["comera"] < peaks[""]["comera"], peaks
    assert peaks["_recompute_factors"]["galore"] == peaks["_recompute"]["galore"], peaks


def test_profile_times_each_rows_kernels_at_the_largest_batch(tmp_path):
    out = tmp_path / "se.json"
    assert six_encoder.main(["--smoke", "--device", "cpu", "--dtypes", "fp32", "--contenders", "dense", "comera",
                             "--modes", "eager", "compiled", "--compile-backend", "aot_eager", "--batch-sizes", "1",
                             "2", "--steps", "1", "--profile", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    timed = r["config"]["kernel_time"]
    assert set(timed) == {f"{c} {m} fp32 b2" for c in ("dense", "comera") for m in ("eager", "compiled")}
    for row in r["rows"]:
        assert ("device_ms" in row) == (row["batch"] == 2), row
        if row["batch"] == 2:
            k = timed[f"{row['contender']} {row['mode']} fp32 b2"]
            assert row["device_ms"] == k["device_ms"] > 0 and k["by_kind_ms"]["gemm"] > 0, k


def test_row_selection_needs_the_device_comparison(capsys):
    for flag in (["--modes", "compiled"], ["--recompute"], ["--recompute-factors"], ["--profile"]):
        with pytest.raises(SystemExit):
            six_encoder.main(["--smoke", *flag])
        assert "--device" in capsys.readouterr().err
