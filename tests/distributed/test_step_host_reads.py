"""No host read between a step's first forward and its optimizer step, on 2 real ranks.

Where DeepSpeed checks the gradients (ZeRO 1-2, fp32 or bf16 with the overflow check: the default), the
session all-reduces L and S on the device, decides lambda there and poisons the gradients of a non-finite
loss instead of reading it, so on a GPU the forward and the backward are queued back to back. The
steps cover both controller stages (late from step 2) with 2 micro-batches each.

A read is anything that brings a tensor's value to the host: ``aten._local_scalar_dense`` (``item()``,
``float()``, ``bool()``, ``math.isfinite(t)`` ...) and the ops whose output size depends on the data
(``bench.ops.SYNC_OPS``: ``nonzero``, ``unique`` ...), counted by a dispatch mode, and ``Tensor.tolist``
(which reads CPU memory without dispatching), wrapped. The window opens when the engine's forward is
entered and closes when its ``step`` is entered at the accumulation boundary. The model runs its GPU
path (``kernels.dispatch.static_shapes``: its CPU-only id range checks and deduplication read ids). ZeRO 0 reads the global
loss before each backward and the gradients before the update (nothing else would skip a non-finite step):
its count is the positive control that the counter sees the session's reads.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from dist_helpers import run_ranks
from engine_cases import factory, micro_batches, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

ACCUM, STEPS = 2, 3


class _Reads(TorchDispatchMode):
    """Counts host reads (with where they came from) while ``open``."""

    def __init__(self) -> None:
        super().__init__()
        self.open, self.seen = False, []

    def note(self, what: str) -> None:
        if self.open:
            frames = [f for f in traceback.extract_stack()[:-2] if "comera_dist" in f.filename or "deepspeed" in f.filename]
            owner = "comera_dist" if frames and "comera_dist" in frames[-1].filename else "deepspeed"  # innermost
            self.seen.append(f"{what} at " + " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-3:])
                             + f" [{owner}]")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from comera_dist.bench.ops import SYNC_OPS

        name = str(func.overloadpacket)
        if name in SYNC_OPS:  # item() & co., and the ops whose output size depends on the data (nonzero ...)
            self.note("item" if name == "aten._local_scalar_dense" else name)
        return func(*args, **(kwargs or {}))


def _count_reads(rank: int, world_size: int, outdir: str, zero_stage: int, precision: str) -> dict:
    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.session import TrainSession
    from comera_dist.kernels.dispatch import static_shapes

    init_distributed(60)
    cfg = tiny_config(outdir, zero_stage=zero_stage, accumulation=ACCUM, steps=STEPS, late_stage_step=2,
                      precision=precision)
    s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
    reads = _Reads()
    engine = s.engine
    forward, step, tolist = engine.forward, engine.step, torch.Tensor.tolist

    def opening_forward(*args, **kwargs):
        reads.open = True
        return forward(*args, **kwargs)

    def closing_step(*args, **kwargs):
        if engine.is_gradient_accumulation_boundary():
            reads.open = False
        return step(*args, **kwargs)

    def noted_tolist(t):
        reads.note("tolist")
        return tolist(t)

    size_calls, size_tensor = [], s._size_tensor

    def counted_size():
        size_calls.append(s.steps_done + 1)
        return size_tensor()

    s._size_tensor = counted_size
    engine.forward, engine.step, torch.Tensor.tolist = opening_forward, closing_step, noted_tolist
    outs = []
    try:
        with reads, static_shapes():  # the model's GPU path: no CPU-only id checks, no deduplication
            for n in range(1, STEPS + 1):
                outs.append(s.train_step(micro_batches(n, rank, ACCUM)))
    finally:
        torch.Tensor.tolist = tolist
    return {"reads": reads.seen, "stages": [o.stage for o in outs], "skipped": [o.skipped_nonfinite for o in outs],
            "zero_skips": s.zero_skips_nonfinite, "size_calls": size_calls}


@pytest.mark.parametrize(("zero_stage", "precision"), [(1, "bf16"), (2, "fp32")])
def test_no_host_read_inside_a_checked_zero_step(tmp_path: Path, zero_stage: int, precision: str) -> None:
    results = run_ranks(_count_reads, tmp_path / "work", str(tmp_path / "run"), zero_stage, precision)
    for rank, r in enumerate(results):
        assert r["zero_skips"] and r["stages"] == ["early", "late", "late"] and not any(r["skipped"]), r
        assert r["reads"] == [], f"rank {rank}: {len(r['reads'])} host reads inside the steps:\n" + "\n".join(r["reads"])
        # S is made only where it is used: twice at the switch (its one read, then lambda's), once per late step
        assert r["size_calls"] == [2, 2, 3], r["size_calls"]


def test_zero0_reads_the_loss_before_each_backward(tmp_path: Path) -> None:
    """The positive control: a plain optimizer skips nothing itself, so the session reads every global loss
    (one per micro-batch), the finite-probe's losses (one read per step: its forwards open the window too),
    the gradients' finiteness before the update (one read per step) and, on the step that switches stage, S."""
    results = run_ranks(_count_reads, tmp_path / "work", str(tmp_path / "run"), 0, "fp32")
    for r in results:
        assert not r["zero_skips"] and r["stages"] == ["early", "late", "late"], r
        assert len(r["reads"]) == STEPS * ACCUM + 2 * STEPS + 1, r["reads"]
        assert all("session.py" in x for x in r["reads"]), r["reads"]



def test_zero3_reads_nothing_for_the_rank_penalty(tmp_path: Path) -> None:
    """ZeRO-3 keeps R on the proxy path (``hooks.PenaltyHook``): the gates' fp32 masters are gathered once per
    step, R, the proxy's gradient and the injection stay on the device. Before, the session read R and the
    proxy's gradient back once per micro-batch each (12 reads here). DeepSpeed's own ZeRO-3 reads (its
    trace checks, ``get_lst_from_rank0``) are its business and not counted."""
    results = run_ranks(_count_reads, tmp_path / "work", str(tmp_path / "run"), 3, "fp32")
    for rank, r in enumerate(results):
        assert r["zero_skips"] and r["stages"] == ["early", "late", "late"] and not any(r["skipped"]), r
        ours = [x for x in r["reads"] if x.endswith("[comera_dist]")]
        assert ours == [], f"rank {rank}: {len(ours)} reads by comera_dist inside the steps:\n" + "\n".join(ours)
        assert any(x.endswith("[deepspeed]") for x in r["reads"])  # the counter sees ZeRO-3's own reads
