"""ZeRO-3's penalty path on 2 real ranks, against DeepSpeed's own per-parameter API.

``hooks.full_fp32_all`` reads every gate's fp32 master in one all-gather; ``PenaltyHook.inject`` adds
``c * dR/dg`` to each rank's partition of the gate gradients. The training equivalence tests cannot see a
scrambled layout: with every gate alive and positive, ``dR/dg`` is the same for every entry of a gate, and R
is a sum over entries. Here the gates hold distinct values, some dead (below tau) and some negative, and
the vectors' sizes do not all divide by the world size.
"""

from __future__ import annotations

from pathlib import Path

import torch
from dist_helpers import run_ranks
from engine_cases import batch, factory, tiny_config


def _distinct_gates(session) -> list[torch.nn.Parameter]:
    """Every gate's fp32 master set to distinct values (a third dead, a few negative); returns the params."""
    from comera_dist.engine.hooks import full_shape, set_full

    params, values = [ref.param for ref in session.penalty.gates], []
    for i, p in enumerate(params):
        n = int(torch.Size(full_shape(p)).numel())
        value = 1.0 + 0.01 * torch.arange(n, dtype=torch.float32) + 0.1 * i
        value[::3] = 0.2 + 0.01 * i  # dead: below tau
        value[1::5] *= -1.0
        set_full(p, value.reshape(full_shape(p)), "fp32")  # DeepSpeed's full setter fails on 9 entries
        values.append(value)
    return params, values


def _check(rank: int, world_size: int, outdir: str) -> dict:
    from deepspeed.utils import safe_get_full_grad

    from comera_dist.compression.penalty import penalty_from_gates
    from comera_dist.engine.distributed import init_distributed
    from comera_dist.engine.hooks import full_fp32, full_fp32_all, full_shape
    from comera_dist.engine.session import TrainSession

    init_distributed(60)
    cfg = tiny_config(outdir, zero_stage=3)
    cfg.comera.tensorize.max_rank = 3  # 3 bonds of 3: 9-entry gate vectors, which 2 ranks split 5 + 4
    s = TrainSession.create(cfg, factory(cfg), world_size=world_size)
    params, intended = _distinct_gates(s)
    sizes = [int(torch.Size(full_shape(p)).numel()) for p in params]

    batched = full_fp32_all(params)
    one_by_one = [full_fp32(p) for p in params]
    set_ok = all(torch.equal(a.reshape(-1), v) for a, v in zip(one_by_one, intended, strict=True))
    same_values = all(torch.equal(a, b) for a, b in zip(batched, one_by_one, strict=True))

    # one backward for real gradients, then the injection against the full-gradient arithmetic
    s.engine.backward(s.engine(**batch(1, rank))["loss"])
    before = [safe_get_full_grad(p).float().reshape(-1).clone() for p in params]
    gates = s.penalty.gates_fp32()
    values = [g.clone().requires_grad_(True) for g in one_by_one]  # DeepSpeed's values, not the batched ones
    taus = [ref.tau for ref in s.penalty.gates]
    d_r = torch.autograd.grad(penalty_from_gates(values, taus, working_dtype=s.penalty.working_dtype), values)
    coef = torch.tensor(0.7)
    s.penalty.inject(coef, gates)
    after = [safe_get_full_grad(p).float().reshape(-1) for p in params]
    errors = [float((a - (b + 0.7 * d.reshape(-1))).abs().max()) for a, b, d in zip(after, before, d_r, strict=True)]
    distinct_d_r = [int(torch.unique(d).numel()) for d in d_r]
    s.close()
    return {"set_ok": set_ok, "same_values": same_values, "sizes": sizes, "errors": errors, "distinct_d_r": distinct_d_r}


def test_batched_gate_gather_and_local_injection_match_deepspeeds_full_api(tmp_path: Path) -> None:
    results = run_ranks(_check, tmp_path / "work", str(tmp_path / "run"))
    for r in results:
        assert any(n % 2 for n in r["sizes"]), r["sizes"]  # a vector that 2 ranks split unevenly
        assert r["set_ok"], r  # set_full wrote each rank's own slice: DeepSpeed reads back the full value
        assert r["same_values"], r
        assert all(n >= 2 for n in r["distinct_d_r"]), r["distinct_d_r"]  # dR/dg differs inside each gate
        assert max(r["errors"]) < 1e-6, r["errors"]
