"""The six-encoder CoMERA training step compiles without graph breaks (``fullgraph=True``), embedding included.

This is the CPU proxy of whole-step CUDA-graph capture (issue 11): a graph break or a host sync
(``.item()``, a data-dependent shape) inside the step fails ``fullgraph=True``. The step is the
one ``bench six-encoder`` times: forward, task loss + gamma * rank penalty, backward, AdamW.
Two regions, each one graph: forward + backward (Dynamo traces ``Tensor.backward`` with
``trace_autograd_ops``), then the optimizer update (torch's ``Optimizer.step`` wrapper graph-breaks
on purpose and the fused AdamW is ``compiler.disable``d, so the test compiles the foreach AdamW's
unwrapped ``step``; ``zero_grad`` only drops references and stays outside). Backend ``eager``:
Dynamo's tracing is what is under test, and it keeps the test short.
"""

from __future__ import annotations

import copy

import pytest
import torch

from comera_dist.compression.config import ControllerConfig, LrConfig, TensorizeConfig
from comera_dist.compression.controller import RankController
from comera_dist.compression.groups import param_groups
from comera_dist.compression.penalty import rank_penalty
from comera_dist.compression.pruning import apply_plan, make_plan
from comera_dist.compression.walk import tensorized_modules
from comera_dist.layers import TTLinear
from comera_dist.models import build_model
from comera_dist.models.config import ModelConfig


def _unwrapped_step(opt: torch.optim.Optimizer):
    fn = type(opt).step
    while hasattr(fn, "__wrapped__"):  # the profiling hook and the no_grad/graph-break wrapper
        fn = fn.__wrapped__
    return fn


def _ragged_prune(model: torch.nn.Module) -> None:
    """Each TT layer loses a different number of ranks: same-mode layers keep different shapes, so
    ``layers.group`` stacks them zero-padded (``layers.ragged``) instead of plainly."""
    with torch.no_grad():
        for i, (_, layer) in enumerate(tensorized_modules(model)):
            for gate in layer.gates:
                gate[: i % gate.numel()] = 0.0
    apply_plan(model, make_plan(model))
    shapes = {tuple(tuple(c.shape) for c in m.cores) for m in model.modules() if isinstance(m, TTLinear)}
    assert len(shapes) > 3  # the three mode classes now hold several rank profiles


@pytest.mark.parametrize("pruned", [False, True], ids=["full", "ragged-prune"])
def test_six_encoder_comera_step_compiles_fullgraph_and_matches_eager(pruned):
    cfg = ModelConfig(arch="six_encoder_cls", vocab_size=40, hidden_size=16, num_layers=1, num_heads=2,
                      intermediate_size=32, max_positions=8, num_labels=3, dropout=0.0)
    torch.manual_seed(0)
    model = build_model(cfg, TensorizeConfig(max_rank=3, embedding_max_rank=3))
    model.embeddings.word.padding_idx = 0  # the padding-row path is traced too
    if pruned:
        _ragged_prune(model)
    twin = copy.deepcopy(model)
    controller = RankController(ControllerConfig())
    gen = torch.Generator().manual_seed(1)
    batch = {"input_ids": torch.randint(0, 40, (2, 8), generator=gen), "labels": torch.tensor([0, 2])}

    def make(m):
        opt = torch.optim.AdamW(param_groups(m, LrConfig()), foreach=True)
        raw = _unwrapped_step(opt)

        def fwd_bwd(b):
            task = m(**b)["loss"]
            loss = controller.objective(task, rank_penalty(m), global_loss=1.0, global_size=1)
            loss.backward()
            return loss.detach()

        def update():
            raw(opt)

        return opt, fwd_bwd, update

    opt_c, fb, up = make(model)
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        fb_c = torch.compile(fb, fullgraph=True, backend="eager")
        up_c = torch.compile(up, fullgraph=True, backend="eager")
        compiled = []
        for _ in range(2):
            compiled.append(fb_c(batch))
            with torch.no_grad():
                up_c()
            opt_c.zero_grad(set_to_none=True)
    opt_e, fb_e, up_e = make(twin)
    eager = []
    for _ in range(2):
        eager.append(fb_e(batch))
        with torch.no_grad():
            up_e()
        opt_e.zero_grad(set_to_none=True)
    torch.testing.assert_close(torch.stack(compiled), torch.stack(eager))
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"{name}: {m}")


def test_no_model_holds_a_parameter_list():
    """torch 2.11's Dynamo (the GPU image's) raises NotImplementedError on unpacking an
    ``nn.ParameterList`` (``*layer.cores`` failed the compiled trainer on the H200); this CPU's 2.13
    accepts it, so the compile tests above cannot see it. The layers hold one flat ``core`` (``cores``
    are views made in the forward), so no model of any architecture, tied or not, has a ParameterList."""
    for arch in ("six_encoder_cls", "bert_mlm", "gpt"):
        cfg = ModelConfig(arch=arch, vocab_size=40, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                          max_positions=8, num_labels=3)
        model = build_model(cfg, TensorizeConfig(max_rank=3, embedding_max_rank=3))
        assert list(tensorized_modules(model)), arch
        assert not [n for n, m in model.named_modules() if isinstance(m, torch.nn.ParameterList)], arch