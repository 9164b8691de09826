"""``TrainSession.gates_finite`` on 2 real ranks: one NaN gate entry is seen by every rank, at ZeRO 1 (packed, the
gates replicated) and at ZeRO 3, where the entry lives in one rank's partition and only the gathered gate shows it.
The trainer asks it when S reads 0 or an embedding bond reads dead, to tell non-finite gates from a collapse of the
ranks (``trainer._check_alive``)."""

from __future__ import annotations

from dist_helpers import run_ranks
from engine_cases import factory, tiny_config


def _gates_finite(rank: int, world_size: int, outdir: str) -> dict[int, list[bool]]:
    import torch

    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.hooks import gate_refs
    from comera_dist.engine.session import TrainSession

    init_distributed(60)
    seen = {}
    for stage in (1, 3):
        cfg = tiny_config(f"{outdir}/z{stage}", zero_stage=stage)
        s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
        before = s.gates_finite()
        gate = max((r.param for r in gate_refs(s.module)), key=lambda p: getattr(p, "ds_numel", p.numel()))
        with torch.no_grad():
            if stage == 3:  # the last entry of rank 1's partition: no other rank holds it
                if rank == 1:
                    gate.ds_tensor.view(-1)[gate.ds_numel - gate.ds_tensor.numel() - 1] = float("nan")
            else:
                gate.view(-1)[-1] = float("nan")  # replicated: every rank holds the same value
        seen[stage] = [before, s.gates_finite()]
        s.close()
    return seen


def test_a_nan_gate_entry_is_seen_by_every_rank(tmp_path):
    results = run_ranks(_gates_finite, tmp_path / "w", str(tmp_path))
    assert results == [{1: [True, False], 3: [True, False]}] * 2, results
