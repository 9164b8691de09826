"""``bench ops`` (aten ops and host syncs per six-encoder step) and ``bench six-encoder --device``, at smoke size."""

from __future__ import annotations

import json

import torch

from comera_dist.bench import ops, six_encoder


def test_counter_sees_syncs_and_data_dependent_shapes():
    x = torch.arange(6.0)
    with ops.OpCounter() as c:
        float(x.sum())  # one host read
        torch.unique(x)  # output size depends on the data
        x[x > 2]  # boolean indexing: a hidden nonzero
        torch.repeat_interleave(torch.tensor([1, 2]))  # no output_size
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)  # static: not a sync
        x.view(2, 3)
    assert c.syncs["aten._local_scalar_dense"] == 1 and c.syncs["aten._unique2"] == 1
    assert c.syncs["aten.index(bool mask)"] == 1 and c.syncs["aten.repeat_interleave"] == 1
    assert sum(c.syncs.values()) == 4 and c.views >= 1 and c.host_only == 0


def test_counter_tells_host_only_ops_from_kernels():
    """``promote_types`` and the profiler's markers touch no tensor; in-place list ops (the fused AdamW's
    ``_foreach_*``) return nothing and factories (``zeros``) take no tensor, but both launch kernels."""
    xs = [torch.ones(2), torch.ones(3)]
    with ops.OpCounter() as c:
        torch.promote_types(torch.float32, torch.bfloat16)
        with torch.autograd.profiler.record_function("marker"):
            torch._foreach_add_(xs, 1.0)
            torch.zeros(2)
    assert c.ops["aten.promote_types"] == 1 and c.ops["aten._foreach_add_"] == 1 and c.ops["aten.zeros"] == 1, c.ops
    assert c.host_only == sum(c.ops.values()) - 2, c.ops  # all but the foreach add and the zeros


def test_ops_smoke_static_step_has_no_sync(tmp_path):
    out = tmp_path / "ops.json"
    assert ops.main(["--smoke", "--compiled", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    m = r["metrics"]
    assert {"ops_per_step_comera", "syncs_per_step_comera", "ops_ratio_comera_over_dense", "ops_per_step_dense",
            "syncs_per_step_dense", "kernel_ops_ratio_comera_over_dense"} <= set(m)
    # the GPU-path proxy: no host read and no data-dependent shape in the CoMERA step
    assert m["syncs_per_step_comera"] == 0 and m["syncs_per_step_comera"] <= m["syncs_per_step_dense"]
    assert m["ops_ratio_comera_over_dense"] == m["ops_per_step_comera"] / m["ops_per_step_dense"]
    by = {(row["contender"], row["policy"], row["precision"]): row for row in r["rows"]}
    # CPU eager keeps its free host work: the id range checks and the torch.unique dedup
    assert "aten._unique2" in by["comera", "cpu_eager", "fp32"]["sync_ops"]
    assert by["comera", "static", "fp32"]["kernel_ops"] < by["comera", "static", "fp32"]["ops"]
    assert m["syncs_excess_comera_over_dense"] <= 0
    # after a prune that gives every layer its own ranks: still no sync (the padded gather is static)
    assert by["comera_pruned", "static", "fp32"]["syncs"] == m["syncs_per_step_comera_pruned"] == 0
    # ... and as many GEMMs as before it: on the GPU path a pruned group's factors keep its padded rank,
    # so no layer leaves its batched chain and Q, K, V's output side stays one batched GEMM
    assert by["comera_pruned", "static", "fp32"]["gemms"] == by["comera", "static", "fp32"]["gemms"] > 0
    assert m["kernel_ops_per_step_comera_pruned"] == by["comera_pruned", "static", "fp32"]["kernel_ops"]
    # bf16 (autocast) rows: autocast's casts are kernels the fp32 step does not run, and no sync either
    for c in ("dense", "comera"):
        bf16, fp32 = by[c, "static", "bf16"], by[c, "static", "fp32"]
        assert bf16["kernel_ops"] > fp32["kernel_ops"] and bf16["syncs"] == 0, (c, bf16, fp32)
        assert "aten._to_copy" in r["config"]["top_ops"][f"{c}/static/bf16"]
        assert m[f"kernel_ops_per_step_{c}_bf16"] == bf16["kernel_ops"]
    assert m["ops_ratio_comera_pruned_over_dense"] == m["ops_per_step_comera_pruned"] / m["ops_per_step_dense"]
    # --compiled: the bf16 loss through inductor is one forward and one backward graph, and its fusion
    # launches fewer kernels than the eager bf16 step's kernel ops (which also hold the optimizer's)
    for c in ("dense", "comera"):
        got = r["config"]["compiled_bf16"][c]
        assert got["graph_calls"] == 2 and got["generated"]["forward"] > 0, (c, got)
        assert 0 < m[f"graph_kernels_per_step_{c}_compiled_bf16"] == got["kernels"] < by[c, "static", "bf16"]["kernel_ops"]
    assert m["graph_kernels_ratio_comera_over_dense_compiled_bf16"] == (
        m["graph_kernels_per_step_comera_compiled_bf16"] / m["graph_kernels_per_step_dense_compiled_bf16"])


def test_six_encoder_device_path_on_cpu(tmp_path):
    out = tmp_path / "se.json"
    assert six_encoder.main(["--smoke", "--device", "cpu", "--batch-sizes", "1", "2", "--steps", "1",
                             "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    m = r["metrics"]
    # the names the GPU run reports, with the device type in them (cuda on a GPU)
    assert {"speedup_vs_dense_b2_cpu_fp32", "speedup_vs_dense_b2_cpu_bf16", "speedup_vs_galore_b1_cpu",
            "memory_ratio_galore_over_comera_b1_cpu"} <= set(m)
    got = {(row["contender"], row["dtype"], row["batch"]) for row in r["rows"]}
    want = {(c, d, b) for c in ("dense", "comera") for d in ("fp32", "bf16") for b in (1, 2)}
    assert got == want | {("galore", d, 1) for d in ("fp32", "bf16")}
    assert all(v > 0 for v in m.values())


def test_model_size_tensor_equals_model_size_without_a_sync():
    from comera_dist.compression.accounting import model_size, model_size_tensor
    from comera_dist.compression.pruning import apply_plan, make_plan

    c = six_encoder.make_contender("comera", smoke=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in c.model.parameters():
            if p.dim() == 1 and p.numel() > 1 and (p == 1).all():  # gates start at 1
                p.copy_(torch.rand(p.shape, generator=g))  # about 1% below tau = 1e-2
                p[0] = 0.0
    with ops.OpCounter() as counter:
        s = model_size_tensor(c.model)
    assert sum(counter.syncs.values()) == 0 and s.dim() == 0
    assert int(s) == model_size(c.model)
    apply_plan(c.model, make_plan(c.model))  # pruned shapes
    assert int(model_size_tensor(c.model)) == model_size(c.model)
