"""``python -m comera_dist.bench ops``: aten ops and host syncs per six-encoder training step, dense vs CoMERA.

A GPU step that dispatches thousands of small kernels is launch-bound, and every host sync
(a tensor read back to Python, an output whose size depends on the data) stalls the GPU and
forbids CUDA-graph capture. Both are counted here on the CPU, where they can be checked in CI:
a ``TorchDispatchMode`` sees every aten op the step runs (forward, backward, penalty and the
optimizer step, exactly ``six_encoder.Contender.train_step``), after warm-up steps.

Syncs are ``aten._local_scalar_dense`` (``.item()``, ``int()``, ``float()``, ``bool()`` of a
tensor) plus the ops whose output size depends on the data (``SYNC_OPS``: ``nonzero``,
``unique``, boolean indexing, ``repeat_interleave`` without ``output_size`` ...): on a GPU each
one waits for the device.

``kernel_ops`` leaves out the ops that only make views (``view``, ``t``, ``select``,
``detach`` ...) and the ops with no tensor among their arguments and results (``promote_types``, the
profiler's ``record_function`` markers): those launch nothing on a GPU, though each still costs host
time in eager mode.

Two policies are counted per contender:

- ``static`` (the headline metrics): the step as it runs on a GPU or under ``torch.compile``,
  emulated on the CPU with ``kernels.dispatch.static_shapes()`` (no CPU-only host checks, no
  data-dependent deduplication) and one intra-op thread: a multi-threaded CPU process wraps the
  small core contractions in ``tensor.smallops.on_one_thread`` (a private autograd graph that
  adds a detach per input and a second backward engine pass), which CUDA tensors and compiled
  graphs bypass, so it is not part of a GPU step;
- ``cpu_eager`` (suffix ``_cpu_eager``): the plain CPU eager step, which also runs the CPU-only
  id range checks and the embedding's ``torch.unique`` deduplication (free of device syncs on
  a CPU, counted anyway), with the process's own thread count (the one-thread wrapper too).

The ``static`` policy is also counted in bf16 (suffix ``_bf16``, dense and CoMERA): the step under
``torch.autocast`` over fp32 weights, as ``bench six-encoder --dtypes bf16`` runs it. Inside a CUDA
graph each kernel op costs about the same whatever its size, so at small batches the bf16 kernel
counts are the gap between the two contenders.

A third contender, ``comera_pruned`` (``static`` only), is CoMERA after a physical prune that left
every layer its own ranks (``ragged_prune``), as training leaves them: its count shows whether the
batched contraction of same-shape layers survives pruning.

``--compiled`` also counts what the GPU's fastest bf16 mode launches: the loss compiled by inductor
(``measure_compiled``), whose forward and backward graphs fuse the element-wise work into generated
kernels and call library kernels (GEMMs) for the rest. ``graph_kernels_per_step_{dense,comera}_compiled_bf16``
count both kinds (``compile_stats.graph_kernels``; the optimizer step outside the graphs is not
counted). The fusion is the CPU's C++ backend's, a proxy for the Triton backend's on a GPU: one
scheduler decides both, each backend with its own rules, and a GPU runs attention as one flash kernel,
not as its GEMMs.

CPU targets (issue 11): ``ops_ratio_comera_over_dense <= 2`` and ``syncs_per_step_comera <=
syncs_per_step_dense``.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from comera_dist.bench.common import base_parser, write_result
from comera_dist.bench.compile_stats import graph_kernels, kernel_profile
from comera_dist.bench.prune_payoff import kill_ranks
from comera_dist.bench.six_encoder import Contender, make_contender, random_batch
from comera_dist.bench.six_encoder_device import compile_loss
from comera_dist.compression.pruning import apply_plan, make_plan
from comera_dist.kernels import dispatch

_aten = torch.ops.aten
SYNC_OPS: frozenset[str] = frozenset({
    "aten._local_scalar_dense", "aten.nonzero", "aten.argwhere", "aten._unique", "aten._unique2",
    "aten.unique_dim", "aten.unique_consecutive", "aten.unique_dim_consecutive", "aten.masked_select",
    "aten.bincount", "aten.equal", "aten.allclose",
})
"""Ops that read device data back to the host (by overload packet name)."""


GEMM_OPS: tuple[str, ...] = ("mm", "addmm", "bmm", "baddbmm")
"""The matrix products (aten names) a row's ``gemms`` counts."""


def _indexes_with_bool(args: tuple) -> bool:
    """``aten.index``/``index_put`` with a boolean mask index: a hidden ``nonzero``."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (indices or ()) if i is not None)


def _host_only(func) -> bool:
    """An op with no tensor among its arguments and results (``Tensor``, ``Tensor?``, ``Tensor[]`` ...)."""
    schema = func._schema
    return not any("Tensor" in str(a.type) for a in (*schema.arguments, *schema.returns))


class OpCounter(TorchDispatchMode):
    """Counts the aten ops (and the syncing ones) dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.syncs: collections.Counter[str] = collections.Counter()
        self.views = 0  # ops that only make views (no kernel launch on a GPU)
        self.host_only = 0  # ops that touch no tensor (no kernel launch anywhere)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] += 1
        self.views += bool(getattr(func, "is_view", False))
        self.host_only += _host_only(func)
        kwargs = kwargs or {}
        if name in SYNC_OPS or (name == "aten.repeat_interleave" and kwargs.get("output_size") is None
                                and func is _aten.repeat_interleave.Tensor):
            self.syncs[name] += 1
        elif name in ("aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_") and \
                _indexes_with_bool(args):
            self.syncs[name + "(bool mask)"] += 1
        return func(*args, **kwargs)


def count_step(step: Callable[[], Any], *, warmup: int = 2) -> OpCounter:
    """Run ``step`` ``warmup`` times, then once under an ``OpCounter``; return the counter."""
    for _ in range(warmup):
        step()
    with OpCounter() as counter:
        step()
    return counter


def ragged_prune(c: Contender, seed: int = 0) -> None:
    """Kill a random 10-70% of every bond's ranks, a different share per layer and bond, and prune
    them out (AdamW state sliced along): the layers of a shape class no longer share core shapes."""
    kill_ranks(c, (0.3, 0.9), seed)
    apply_plan(c.model, make_plan(c.model), c.optimizer)


def measure(name: str, *, smoke: bool, batch_size: int, policy: str,
            autocast: torch.dtype | None = None) -> dict[str, Any]:
    """Counts for one contender under ``policy`` (``static`` or ``cpu_eager``), the forward under
    ``autocast`` to that dtype when given."""
    c = make_contender("comera" if name == "comera_pruned" else name, smoke=smoke)
    c.autocast = autocast
    batch = random_batch(c.model, batch_size, smoke=smoke)
    if name == "comera_pruned":
        c.train_step(batch)  # AdamW state exists before the prune, as in training
        ragged_prune(c)
    with gpu_path() if policy == "static" else contextlib.nullcontext():
        counter = count_step(lambda: c.train_step(batch))
    total = sum(counter.ops.values())
    return {"contender": name, "policy": policy, "precision": "bf16" if autocast else "fp32",
            "ops": total, "kernel_ops": total - counter.views - counter.host_only,
            "gemms": sum(counter.ops[f"aten.{op}"] for op in GEMM_OPS),
            "syncs": sum(counter.syncs.values()), "sync_ops": dict(counter.syncs.most_common()),
            "top_ops": dict(counter.ops.most_common(12))}


def measure_compiled(name: str, *, smoke: bool, batch_size: int) -> dict[str, Any]:
    """Kernels per step of ``name``'s bf16 loss compiled by inductor (``fullgraph=True``, as ``bench
    six-encoder --modes compiled`` runs it), on the GPU path (``static_shapes``, one thread):
    ``compile_stats.graph_kernels`` of one step after two warm-up steps (the compilation)."""
    c = make_contender(name, smoke=smoke)
    c.autocast = torch.bfloat16
    batch = random_batch(c.model, batch_size, smoke=smoke)
    try:
        with gpu_path(), kernel_profile():
            compile_loss(c, "inductor")
            for _ in range(2):  # the first step compiles
                c.train_step(batch)
            return graph_kernels(lambda: c.train_step(batch))
    finally:
        torch._dynamo.reset()


@contextlib.contextmanager
def gpu_path() -> Iterator[None]:
    """The GPU path emulated on the CPU (the ``static`` policy): ``dispatch.static_shapes()`` and one
    intra-op thread, so no ``smallops.on_one_thread`` wrapper either."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with dispatch.static_shapes():
            yield
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str]) -> int:
    p = base_parser("ops", "aten ops and host syncs per six-encoder training step, dense vs CoMERA")
    p.add_argument("--smoke", action="store_true", help="tiny model of the same architecture (CI)")
    p.add_argument("--compiled", action="store_true",
                   help="also count the kernels of the bf16 step compiled by inductor, dense and CoMERA "
                        "(two compilations: about 100 s at full size on 2 cores)")
    args = p.parse_args(argv)
    batch = 2 if args.batch_size is None else args.batch_size  # op counts do not depend on the batch size
    if batch < 1:
        p.error(f"--batch-size must be >= 1, got {batch}")
    rows = [measure(n, smoke=args.smoke, batch_size=batch, policy=pol)
            for pol in ("static", "cpu_eager") for n in ("dense", "comera")]
    rows.append(measure("comera_pruned", smoke=args.smoke, batch_size=batch, policy="static"))
    rows += [measure(n, smoke=args.smoke, batch_size=batch, policy="static", autocast=torch.bfloat16)
             for n in ("dense", "comera")]
    by = {(r["contender"], r["policy"], r["precision"]): r for r in rows}
    metrics: dict[str, float] = {}
    for pol, prec, sfx in (("static", "fp32", ""), ("cpu_eager", "fp32", "_cpu_eager"),
                           ("static", "bf16", "_bf16")):
        d, c = by["dense", pol, prec], by["comera", pol, prec]
        metrics |= {f"ops_per_step_comera{sfx}": c["ops"], f"syncs_per_step_comera{sfx}": c["syncs"],
                    f"ops_per_step_dense{sfx}": d["ops"], f"syncs_per_step_dense{sfx}": d["syncs"],
                    f"ops_ratio_comera_over_dense{sfx}": c["ops"] / d["ops"],
                    f"kernel_ops_per_step_comera{sfx}": c["kernel_ops"], f"kernel_ops_per_step_dense{sfx}": d["kernel_ops"],
                    f"kernel_ops_ratio_comera_over_dense{sfx}": c["kernel_ops"] / d["kernel_ops"]}
    metrics["syncs_excess_comera_over_dense"] = metrics["syncs_per_step_comera"] - metrics["syncs_per_step_dense"]
    pruned = by["comera_pruned", "static", "fp32"]
    metrics |= {"ops_per_step_comera_pruned": pruned["ops"], "syncs_per_step_comera_pruned": pruned["syncs"],
                "kernel_ops_per_step_comera_pruned": pruned["kernel_ops"],
                "ops_ratio_comera_pruned_over_dense": pruned["ops"] / by["dense", "static", "fp32"]["ops"]}
    compiled: dict[str, dict[str, Any]] = {}
    if args.compiled:
        compiled = {n: measure_compiled(n, smoke=args.smoke, batch_size=batch) for n in ("dense", "comera")}
        metrics |= {f"graph_kernels_per_step_{n}_compiled_bf16": compiled[n]["kernels"] for n in compiled}
        metrics["graph_kernels_ratio_comera_over_dense_compiled_bf16"] = (
            compiled["comera"]["kernels"] / compiled["dense"]["kernels"])
    met = {"ops_ratio_comera_over_dense": metrics["ops_ratio_comera_over_dense"] <= 2,
           "syncs_comera_le_dense": metrics["syncs_per_step_comera"] <= metrics["syncs_per_step_dense"]}
    config = {"smoke": args.smoke, "batch_size": batch, "warmup_steps": 2,
              "threads": {"static": 1, "cpu_eager": torch.get_num_threads()},
              "step": "six_encoder.Contender.train_step: forward + backward + penalty + optimizer step",
              "sync_ops": sorted(SYNC_OPS) + ["aten.repeat_interleave.Tensor without output_size",
                                              "aten.index/index_put with a bool mask"],
              "target": {"ops_ratio_comera_over_dense": 2.0, "syncs_per_step_comera": "<= syncs_per_step_dense"},
              "targets_met": met, "compiled_bf16": compiled,
              "top_ops": {f"{r['contender']}/{r['policy']}/{r['precision']}": r["top_ops"] for r in rows}}
    table = [{k: v for k, v in r.items() if k not in ("top_ops", "sync_ops")} |
             {"sync_ops": ", ".join(f"{k} x{v}" for k, v in r["sync_ops"].items()) or "-"} for r in rows]
    write_result(args.json, "ops", metrics, table, config, argv=argv)
    return 0
