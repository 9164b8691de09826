"""CI smoke of the benchmark suite: each benchmark at a tiny size writes finite metrics; summary renders them.

The benchmarks run once per module (``results`` fixture) into a temporary docs/bench; the tests
then check each result's metric names, finiteness and internal consistency.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from comera_dist.bench import codebert, galore, memory, prune_payoff, six_encoder, summary
from comera_dist.bench.__main__ import available

MODULES = {"six-encoder": six_encoder, "galore": galore, "codebert": codebert, "prune-payoff": prune_payoff,
           "memory": memory}
ARGS = {"six-encoder": ["--batch-sizes", "1", "4"], "galore": [], "codebert": ["--steps", "4", "--eval-every", "2",
                                                                              "--eval-batches", "2",
                                                                              "--dense-lr", "1e-3", "--dense-lr", "0.2"],
        "prune-payoff": ["--batch-size", "4"], "memory": ["--batch-size", "4"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("bench")
    mp = pytest.MonkeyPatch()
    mp.setenv("COMERA_CACHE", str(out / "cache"))  # codebert's data cache, private to this run
    try:
        for name, mod in MODULES.items():
            argv = ["--smoke", "--json", str(out / f"{name}.json")] + ARGS[name]
            if "--steps" not in argv:
                argv += ["--steps", "1"]
            assert mod.main(argv) == 0
    finally:
        mp.undo()
    return {name: json.loads((out / f"{name}.json").read_text()) for name in MODULES} | {"_dir": out}


def _finite(metrics: dict) -> None:
    assert metrics, "no metrics"
    for k, v in metrics.items():
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, f"{k} = {v!r}"


def test_benchmarks_are_listed():
    assert set(MODULES) <= set(available())


def test_six_encoder(results):
    r = results["six-encoder"]
    _finite(r["metrics"])
    assert {"speedup_vs_dense_b1", "speedup_vs_dense_b4"} <= set(r["metrics"])
    by = {(row["contender"], row["batch"]): row for row in r["rows"]}
    assert set(by) == {(c, b) for c in ("dense", "comera") for b in (1, 4)}
    assert r["metrics"]["speedup_vs_dense_b4"] == pytest.approx(by["dense", 4]["step_s"] / by["comera", 4]["step_s"])
    assert by["comera", 1]["params"] < by["dense", 1]["params"]
    # activations grow with the batch; the CoMERA model holds fewer parameter bytes
    assert by["dense", 4]["activations_MiB"] > by["dense", 1]["activations_MiB"]
    assert set(r["config"]["profile"]) == {"dense", "comera"}


def test_galore(results):
    r = results["galore"]
    _finite(r["metrics"])
    assert {"speedup_vs_galore_b1", "memory_ratio_galore_over_comera_b1", "rss_ratio_galore_over_comera_b1"} <= set(
        r["metrics"])
    by = {row["contender"]: row for row in r["rows"]}
    assert set(by) == {"dense", "galore", "comera"}
    # GaLore keeps the dense parameters but projects the Adam moments: less optimizer state than AdamW
    assert by["galore"]["params_MiB"] == pytest.approx(by["dense"]["params_MiB"])
    assert by["galore"]["optimizer_MiB"] < by["dense"]["optimizer_MiB"]
    assert r["config"]["galore"]["galore_params"] > 0
    assert r["config"]["process_per_contender"] is True
    # the step's peak of live tensors: at least the parameters and optimizer state held through it
    assert all(row["peak_MiB"] >= row["params_MiB"] + row["optimizer_MiB"] for row in r["rows"]), r["rows"]
    assert r["metrics"]["peak_ratio_galore_over_comera_b1"] == pytest.approx(
        by["galore"]["peak_MiB"] / by["comera"]["peak_MiB"])


@pytest.mark.parametrize("flag", ["--recompute", "--recompute-factors"])
def test_galore_recompute_compares_the_peaks(tmp_path: Path, flag: str):
    out = tmp_path / "galore.json"
    assert galore.main(["--smoke", "--steps", "1", flag, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    suffix = "_" + flag[2:].replace("-", "_")
    assert r["config"]["recompute"] is True
    assert r["config"]["recompute_factors"] is (flag == "--recompute-factors")
    # CoMERA's probe remade its factors; dense and GaLore have none to remake
    assert {row["contender"]: row["recompute_factors"] for row in r["rows"]} == {
        "dense": False, "galore": False, "comera": flag == "--recompute-factors"}
    # the saved-tensor accounting cannot see the recomputed blocks: no tensor-memory ratio in this run
    assert set(r["metrics"]) == {f"{m}_b1{suffix}" for m in (
        "speedup_vs_galore", "speedup_vs_galore_amortized", "speedup_vs_dense", "peak_ratio_galore_over_comera",
        "peak_ratio_dense_over_comera", "rss_ratio_galore_over_comera")}
    assert set(r["config"]["target"]) == {f"speedup_vs_galore_b1{suffix}", f"peak_ratio_galore_over_comera_b1{suffix}"}
    assert summary.rebuilt_command("galore", r)[-2:] == [flag, "--smoke"]  # the page's command runs this again


def test_memory(results):
    r = results["memory"]
    _finite(r["metrics"])
    by = {row["contender"]: row for row in r["rows"]}
    for row in by.values():
        parts = sum(row[f"{k}_MiB"] for k in ("params", "grads", "optimizer", "activations"))
        assert row["total_MiB"] == pytest.approx(parts)
    assert by["dense"]["params_MiB"] > by["comera"]["params_MiB"]


def test_prune_payoff(results):
    r = results["prune-payoff"]
    _finite(r["metrics"])
    m = r["metrics"]
    assert m["step_time_ratio_over_flop_ratio"] == pytest.approx(m["step_time_ratio"] / m["flop_ratio"])
    assert m["flop_ratio"] < 1 and m["tt_flop_ratio"] < 1  # pruning half the ranks removes counted FLOPs
    masked, pruned = r["rows"]
    assert pruned["physical_tt_params"] < masked["physical_tt_params"]


def test_codebert(results):
    r = results["codebert"]
    _finite(r["metrics"])
    assert {"compression_ratio", "val_loss_ratio_comera_over_dense", "epoch_speedup_vs_dense"} <= set(r["metrics"])
    curves = r["config"]["curves"]
    assert [p["step"] for p in curves["dense"]] == [0, 2, 4] == [p["step"] for p in curves["comera"]]
    rows = {row["contender"]: row for row in r["rows"]}
    assert rows["dense"]["tokens"] == rows["comera"]["tokens"]  # equal token budget
    assert r["metrics"]["compression_ratio"] > 1


def test_codebert_compares_the_best_of_its_dense_learning_rates(results):
    r = results["codebert"]
    rows = {row["contender"]: row for row in r["rows"]}
    dense = {row["lr"]: row for name, row in rows.items() if name.startswith("dense")}
    assert set(dense) == {1e-3, 0.2} and set(r["config"]["curves"]) == set(rows)
    chosen = min(dense.values(), key=lambda row: row["final_val_loss"])
    assert rows["dense"] is chosen and f"dense lr={max(dense, key=lambda lr: dense[lr]['final_val_loss']):g}" in rows
    assert dense[0.2]["final_val_loss"] != dense[1e-3]["final_val_loss"]  # the rate reached the optimizer
    assert r["metrics"]["val_loss_ratio_comera_over_dense"] == pytest.approx(
        rows["comera"]["final_val_loss"] / chosen["final_val_loss"])
    assert r["config"]["dense_lr"] == chosen["lr"]
    assert "--dense-lr 1e-3 --dense-lr 0.2" in r["config"]["bench_command"]


@pytest.mark.parametrize("lrs", [["0"], ["-1e-3"], ["nan"], ["1e-3", "1e-3"]])
def test_bad_dense_lr_is_a_usage_error(lrs, capsys):
    with pytest.raises(SystemExit) as exc:
        codebert.main(["--smoke", *[a for lr in lrs for a in ("--dense-lr", lr)]])
    assert exc.value.code == 2 and "--dense-lr" in capsys.readouterr().err


def test_summary_renders_targets_and_plots(results):
    out_dir = results["_dir"]
    page = out_dir / "doc" / "benchmarks.md"
    assert summary.main(["--bench-dir", str(out_dir), "--out", str(page)]) == 0
    text = page.read_text()
    for name in MODULES:
        assert f"## {name}" in text
    for metric in ("speedup_vs_dense_b32", "speedup_vs_galore_b1", "compression_ratio",
                   "step_time_ratio_over_flop_ratio"):
        assert f"`{metric}`" in text
    assert "(this result carries no profile)" not in text.split("## prune-payoff")[1].split("## memory")[0]
    assert (out_dir / "six-encoder.png").stat().st_size > 1000


@pytest.mark.parametrize(("rule", "target", "value", "met"), [(">=", 5.0, 5.0, True), (">=", 5.0, 2.5, False),
                                                             ("<=", 1.03, 1.01, True), ("<=", 1.03, 1.1, False),
                                                             ("within", (0.8, 1.2), 1.19, True),
                                                             ("within", (0.8, 1.2), 0.5, False)])
def test_summary_check(rule, target, value, met):
    ok, gap = summary.check(rule, target, value)
    assert ok is met
    if rule == ">=" and not met:
        assert gap == "2.00x short"


def test_summary_rejects_foreign_json(tmp_path: Path):
    (tmp_path / "x.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match=r"x\.json is not a benchmark result"):
        summary.render(tmp_path, tmp_path / "out.md")
    with pytest.raises(ValueError, match="no benchmark JSON"):
        summary.render(tmp_path / "doc", tmp_path / "out.md")


@pytest.mark.parametrize("mod", [six_encoder, prune_payoff, galore, memory])
def test_bad_steps_is_a_usage_error(mod, capsys):
    with pytest.raises(SystemExit) as exc:
        mod.main(["--smoke", "--steps", "0"])
    assert exc.value.code == 2
    assert "--steps" in capsys.readouterr().err


@pytest.mark.parametrize("mod", [prune_payoff, galore, memory])
def test_bad_batch_size_is_a_usage_error(mod, capsys):
    with pytest.raises(SystemExit) as exc:
        mod.main(["--smoke", "--batch-size", "0"])
    assert exc.value.code == 2
    assert "--steps and --batch-size must be >= 1, got" in capsys.readouterr().err


def test_bad_contender_and_config(tmp_path: Path):
    with pytest.raises(ValueError, match="contender must be one of .*'adam'"):
        six_encoder.make_contender("adam", smoke=True)
    bad = tmp_path / "c.yaml"
    bad.write_text("model: {arch: bert_mlm}\n")
    with pytest.raises(ValueError, match=r"c\.yaml has no 'comera' section"):
        codebert.load_sections(bad, smoke=True)
    model, _, _, _ = codebert.load_sections(codebert.DEFAULT_CONFIG, smoke=False,
                                            overrides=["model.hidden_size=96", "model.num_heads=3"])
    assert (model.hidden_size, model.num_heads) == (96, 3)
    with pytest.raises(ValueError, match="hiden"):
        codebert.load_sections(codebert.DEFAULT_CONFIG, smoke=False, overrides=["model.hiden=3"])


def test_summary_judges_a_run_by_its_own_recorded_target(tmp_path: Path):
    """A variant run that records its own thresholds (``bench codebert --target-ratio 8``) is judged by them."""
    result = {"benchmark": "codebert", "machine": {}, "rows": [],
              "config": {"target": {"compression_ratio": 8.0}},
              "metrics": {"compression_ratio": 6.0, "val_loss_ratio_comera_over_dense": 1.0,
                          "epoch_speedup_vs_dense": 3.5}}
    (tmp_path / "codebert-tied.json").write_text(json.dumps(result))
    page = tmp_path / "out.md"
    summary.render(tmp_path, page)
    text = page.read_text()
    assert "| `compression_ratio` | whole-model compression at the end of training | >= 8 | 6 | MISSED" in text
    assert "| `epoch_speedup_vs_dense` |" in text and ">= 3 | 3.5 | met" in text


def test_summary_judges_a_device_run_by_its_own_targets_only(tmp_path: Path):
    """A GPU six-encoder run is judged by the targets it recorded, not by the CPU run's (absent) metric."""
    result = {"benchmark": "six-encoder", "machine": {"gpu": "NVIDIA H200"}, "rows": [],
              "config": {"target": {"speedup_vs_dense_b32_cuda_fp32": 2.0, "speedup_vs_dense_b32_cuda_bf16": 1.5}},
              "metrics": {"speedup_vs_dense_b32_cuda_fp32": 2.5, "speedup_vs_dense_b32_cuda_bf16": 0.8}}
    (tmp_path / "six-encoder-cuda.json").write_text(json.dumps(result))
    page = tmp_path / "out.md"
    summary.render(tmp_path, page)
    text = page.read_text()
    assert "`speedup_vs_dense_b32` |" not in text  # the CPU target does not apply to this run
    assert "| `speedup_vs_dense_b32_cuda_fp32` | target recorded by the run | >= 2 | 2.5 | met |" in text
    assert "| `speedup_vs_dense_b32_cuda_bf16` | target recorded by the run | >= 1.5 | 0.8 | MISSED" in text
