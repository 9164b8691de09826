"""The rank controller inside a real (tiny, CPU) training: the late stage runs, lambda flips both ways.

A TT student (ranks 4) learns a rank-1 TT teacher. Early stage: ``L + gamma R``. From step
25 the late stage aims at half the size (S* = 80 of 160) and a task loss L* = 0.05. While
the size is further from its target, lambda = 1 and the gates shrink; ranks die and are
physically pruned every 10 steps (AdamW state sliced); the loss then rises relative to
its target and lambda returns to 0. Single process, so the "global" values the engine
would all-reduce are the local ones here.
"""

import itertools

import torch

from comera_dist.compression.accounting import model_size
from comera_dist.compression.config import ControllerConfig, LrConfig
from comera_dist.compression.controller import RankController
from comera_dist.compression.groups import param_groups
from comera_dist.compression.penalty import rank_penalty
from comera_dist.compression.pruning import apply_plan, make_plan
from comera_dist.layers.linear import TTLinear


def test_late_stage_runs_and_lambda_switches_both_ways():
    g = torch.Generator().manual_seed(0)
    teacher = TTLinear(16, 16, num_cores=4, max_rank=1, bias=False, generator=g)
    student = TTLinear(16, 16, num_cores=4, max_rank=4, generator=g)
    x = torch.randn(64, 16, generator=g)  # (B, 16)
    with torch.no_grad():
        y = teacher(x)  # (B, 16)
    opt = torch.optim.AdamW(param_groups(student, LrConfig(cores=2e-2, gates=5e-2, dense=2e-2)))
    ctl = RankController(ControllerConfig(late_stage_step=25, target_ratio=0.5, target_loss=0.05))

    lams, sizes, switched = [], [], []
    for step in range(100):
        opt.zero_grad()
        loss = ((student(x) - y) ** 2).mean() / y.pow(2).mean()  # relative MSE
        size = model_size(student)
        switched.append(ctl.advance(step, global_loss=loss.item(), global_size=size))
        ctl.objective(loss, rank_penalty(student), global_loss=loss.item(), global_size=size).backward()
        opt.step()
        lams.append(ctl.lam)
        sizes.append(size)
        if ctl.stage == "late" and step % 10 == 0:
            apply_plan(student, make_plan(student), opt)

    assert switched.index(True) == 25 and sum(switched) == 1
    assert ctl.state.size_at_switch == 160 and ctl.state.target_size == 80.0
    assert lams[:25] == [None] * 25 and None not in lams[25:]
    pairs = list(itertools.pairwise(lams[25:]))
    up, down = pairs.count((0, 1)), pairs.count((1, 0))
    assert up >= 2 and down >= 2, "".join(map(str, lams[25:]))
    assert ctl.state.lam_switches == up + down
    # the size objective really acted: ranks died and were sliced out of the cores
    assert sizes[-1] <= ctl.state.target_size < sizes[25]
    assert sum(student.bond_dims()) < 4 + 4 + 4 and model_size(student) <= ctl.state.target_size
