"""Measured memory of one training step: tensor bytes by role, and peak RSS of a fresh process.

Two ways, both measured, never modelled:

- **tensor memory** (``StepMemory``): parameters, gradients and optimizer state are summed
  over the unique storages that hold them after the step; the peak of saved activations is
  the total of the unique storages that autograd saved during the forward pass (recorded with
  ``torch.autograd.graph.saved_tensors_hooks``; storages that belong to parameters are not
  activations and are left out). Saved tensors stay alive until backward, so their sum at the
  end of the forward pass is their peak. On CUDA ``torch.cuda.max_memory_allocated`` is added.
- **peak RSS above the post-import baseline**: ``python -m comera_dist.bench memory-probe``
  is the worker the ``galore`` and ``memory`` benchmarks start, one process per contender. After
  the imports it resets the kernel's high-water mark (``/proc/self/clear_refs``), reads the
  baseline RSS, builds the model and optimizer, runs the steps and reads ``VmHWM``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from comera_dist.bench.common import output_file


@dataclass(kw_only=True, slots=True)
class StepMemory:
    """Bytes held by each role during one training step (measured on its tensors)."""

    params_bytes: int
    """Unique storages of the model's parameters."""
    grads_bytes: int
    """Unique storages of the parameters' ``.grad`` after backward."""
    optimizer_bytes: int
    """Tensors in the optimizer's state (AdamW moments, GaLore projectors) after the step."""
    activations_bytes: int
    """Peak of the tensors autograd saved for backward (parameters excluded)."""

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes + self.activations_bytes

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total_bytes": self.total_bytes}


def _storage_key(t: Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def unique_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and shared storages count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        ptr, nbytes = _storage_key(t)
        seen[ptr] = max(seen.get(ptr, 0), nbytes)
    return sum(seen.values())


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[Tensor]:
    """Every tensor in the optimizer state, also inside helper objects (GaLore's projector)."""

    def walk(obj: Any, depth: int = 0) -> Iterator[Tensor]:
        if isinstance(obj, Tensor):
            yield obj
        elif depth > 3:
            return
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from walk(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from walk(v, depth + 1)
        elif hasattr(obj, "__dict__"):
            for v in vars(obj).values():
                yield from walk(v, depth + 1)

    for state in optimizer.state.values():
        yield from walk(state)


class SavedActivations:
    """Context manager recording the unique storages autograd saves (parameters excluded)."""

    def __init__(self, model: nn.Module) -> None:
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._saved: dict[int, int] = {}

    @property
    def bytes(self) -> int:
        return sum(self._saved.values())

    def _pack(self, t: Tensor) -> Tensor:
        ptr, nbytes = _storage_key(t)
        if ptr not in self._param_ptrs and nbytes:
            self._saved[ptr] = max(self._saved.get(ptr, 0), nbytes)
        return t

    @contextmanager
    def record(self) -> Iterator[SavedActivations]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self


def measure_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[[], Tensor]) -> StepMemory:
    """Run one full step (forward under the hooks, backward, ``optimizer.step``) and measure it.

    ``loss_fn()`` runs the forward pass and returns the 0-d loss. Gradients are cleared after.
    """
    saved = SavedActivations(model)
    with saved.record():
        loss = loss_fn()
    loss.backward()
    params = list(model.parameters())
    grads_bytes = unique_bytes(p.grad for p in params if p.grad is not None)
    optimizer.step()
    mem = StepMemory(params_bytes=unique_bytes(params), grads_bytes=grads_bytes,
                     optimizer_bytes=unique_bytes(optimizer_tensors(optimizer)),
                     activations_bytes=saved.bytes)
    optimizer.zero_grad(set_to_none=True)
    return mem


def step_peak_bytes(step: Callable[[], object]) -> int:
    """Peak bytes of the CPU tensors alive at once while ``step()`` runs: parameters, optimizer state,
    gradients, saved and transient activations, temporaries (what ``torch.cuda.max_memory_allocated``
    reads on a GPU, without the allocator's rounding).

    From ``torch.profiler``'s memory timeline: every tensor the step touches or makes, with its
    creation and destruction (torch deprecates the export in favour of the CUDA-only memory history;
    the CPU has no allocator statistics). Unlike ``measure_step``'s saved-tensor accounting it also
    sees activations made in backward, as a block recomputed there (``model.activation_checkpointing``).
    """
    import tempfile
    import warnings

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        step()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*export_memory_timeline.*deprecated")
        path = Path(tmp) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        _, sizes = json.loads(path.read_text())  # [times, bytes per category at each time]
    if not sizes:
        raise RuntimeError("torch.profiler recorded no CPU tensor memory for the step")
    return int(max(sum(row) for row in sizes))


# ---- peak RSS: one process per contender ---------------------------------------------------

def _rss_bytes(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process in bytes (Linux ``/proc``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} line")


def _reset_peak_rss() -> None:
    """Reset ``VmHWM`` to the current RSS (Linux >= 4.0: write 5 to ``clear_refs``)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_probe(*, workload: str, contender: str, batch_size: int, steps: int, smoke: bool,
              threads: int | None = None, profile: bool = False, recompute: bool = False,
              recompute_factors: bool = False, timeout_s: float = 3600.0) -> dict[str, Any]:
    """Start ``memory-probe`` for one contender in a fresh interpreter and return its JSON result.
    ``recompute_factors`` implies ``recompute`` (``model.recompute_factors`` needs the checkpointed blocks)."""
    from comera_dist.bench.six_encoder import CONTENDERS

    if contender not in CONTENDERS:
        raise ValueError(f"run_probe: contender must be one of {list(CONTENDERS)}, got {contender!r}")
    if batch_size < 1 or steps < 1:
        raise ValueError(f"run_probe: batch_size and steps must be >= 1, got {batch_size} and {steps}")
    cmd = [sys.executable, "-m", "comera_dist.bench", "memory-probe", "--workload", workload,
           "--contender", contender, "--batch-size", str(batch_size), "--steps", str(steps)]
    if smoke:
        cmd.append("--smoke")
    if threads:
        cmd += ["--threads", str(threads)]
    if profile:
        cmd.append("--profile")
    if recompute_factors:
        cmd.append("--recompute-factors")
    elif recompute:
        cmd.append("--recompute")
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"memory-probe for contender {contender!r} exited {proc.returncode}:\n"
                           f"{proc.stderr[-3000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE_RESULT ")]
    if len(lines) != 1:
        raise RuntimeError(f"memory-probe for {contender!r} printed no PROBE_RESULT line:\n{proc.stdout[-2000:]}")
    return json.loads(lines[0][len("PROBE_RESULT "):])


def main(argv: list[str]) -> int:
    """Worker: one contender, one process; prints ``PROBE_RESULT {json}``."""
    p = argparse.ArgumentParser(prog="python -m comera_dist.bench memory-probe", description=main.__doc__)
    p.add_argument("--workload", choices=["six-encoder"], default="six-encoder")
    p.add_argument("--contender", required=True, help="dense | galore | comera")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--steps", type=int, default=3, help="timed steps after the measured first step")
    p.add_argument("--smoke", action="store_true", help="tiny model (CI)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--profile", action="store_true", help="add torch.profiler top ops of one more step")
    p.add_argument("--recompute", action="store_true",
                   help="the model recomputes each block in backward (model.activation_checkpointing)")
    p.add_argument("--recompute-factors", action="store_true",
                   help="as --recompute, and each recomputed block also remakes its TT factors L/R "
                        "(model.recompute_factors)")
    p.add_argument("--json", type=output_file, default=None, help="also write the result here")
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.steps < 1:
        p.error(f"--batch-size and --steps must be >= 1, got {args.batch_size} and {args.steps}")
    from comera_dist.bench import six_encoder as work  # the workload's imports belong to the baseline

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.contender not in work.CONTENDERS:
        p.error(f"--contender must be one of {list(work.CONTENDERS)}, got {args.contender!r}")
    import galore_torch  # noqa: F401  every contender pays the same imports before the baseline

    gc.collect()
    _reset_peak_rss()
    baseline = _rss_bytes("VmRSS")
    setup = work.make_contender(args.contender, smoke=args.smoke, recompute=args.recompute,
                                recompute_factors=args.recompute_factors)
    batch = work.random_batch(setup.model, args.batch_size, smoke=args.smoke)
    t0 = time.perf_counter()
    mem = measure_step(setup.model, setup.optimizer, lambda: setup.loss(batch))
    first_s = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        setup.step(batch)
        times.append(time.perf_counter() - t0)
    peak = _rss_bytes("VmHWM")
    step_peak = step_peak_bytes(lambda: setup.step(batch))  # after VmHWM: the profiler's own memory is not the step's
    profile = work.top_ops(lambda: setup.step(batch)) if args.profile else None
    result = {
        "contender": args.contender, "batch_size": args.batch_size, "steps": args.steps,
        "step_s": statistics.median(times), "step_min_s": min(times), "first_step_s": first_s,
        "tensor_memory": mem.as_dict(), "step_peak_bytes": step_peak,
        "recompute": args.recompute or args.recompute_factors, "recompute_factors": args.recompute_factors,
        "rss_baseline_bytes": baseline, "rss_peak_bytes": peak,
        "rss_peak_above_baseline_bytes": peak - baseline, "threads": torch.get_num_threads(),
        "extra": setup.extra, "profile": profile,
    }
    if not all(math.isfinite(v) for v in (result["step_s"], first_s)):
        raise RuntimeError(f"non-finite timing {result}")
    print("PROBE_RESULT " + json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0
