"""Smoke test of ``python -m comera_dist.bench layers``: the JSON carries every required metric."""

import json

from comera_dist.bench.__main__ import main


def test_layers_benchmark_writes_the_metrics(tmp_path, capsys):
    out = tmp_path / "layers.json"
    assert main(["layers", "--json", str(out), "--steps", "1", "--batch-size", "64"]) == 0
    result = json.loads(out.read_text())
    m = result["metrics"]
    for key in ("tt_linear_speedup_vs_dense", "ttm_lookup_speedup_vs_naive", "ttm_lookup_memory_ratio_vs_naive",
                "tt_linear_gflop", "dense_linear_gflop", "ttm_lookup_gflop", "ttm_naive_gflop",
                "tt_linear_saved_mb", "ttm_lookup_saved_mb", "ttm_naive_saved_mb"):
        assert key in m, key
        assert m[key] > 0, (key, m[key])
    # Counted, not assumed: 64 tokens through 768x3072 at r=30 (fwd+bwd) and the dense layer.
    assert 10 < m["tt_linear_flop_ratio_vs_dense"] < 20.3
    assert m["ttm_naive_saved_mb"] > m["ttm_lookup_saved_mb"] > 0
    assert result["config"]["tokens"] == 64 and len(result["rows"]) == 4
    assert "tt_linear_speedup_vs_dense" in capsys.readouterr().out
