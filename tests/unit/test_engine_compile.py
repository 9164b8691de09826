"""``train.compile``'s options (``engine.trainer.compile_options``): the training graph keeps static
shapes whatever batch shapes the evaluation fed the module before it."""

from __future__ import annotations

import torch

from comera_dist.config import load_run_config
from comera_dist.engine.packing import pack_vectors
from comera_dist.engine.trainer import compile_options
from comera_dist.models import build_model


def _batch(batch: int, seq: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_a_short_evaluation_batch_leaves_the_training_graph_static():
    """The trainer evaluates at step 0, before the first training step, and the evaluation's last batch
    may be short. With Dynamo's automatic dynamic shapes that second shape made the batch dimension a
    symbolic input of the next graph compiled, the training graph (a SymInt among its inputs). With the
    trainer's options every graph has static shapes: the short batch gets a graph of its own."""
    cfg = load_run_config("configs/tiny-cpu.yaml", ["train.compile=true", "train.compile_mode=reduce-overhead"])
    assert compile_options(cfg) == {"dynamic": False, "mode": "reduce-overhead"}
    model = build_model(cfg.model, cfg.comera)
    pack_vectors(model)  # as the trainer's ZeRO-1 engine holds it
    inputs: list[list[object]] = []

    def record(gm, example_inputs):
        inputs.append(list(example_inputs))
        return gm.forward

    options = {k: v for k, v in compile_options(cfg).items() if k != "mode"}  # a mode belongs to inductor
    model.compile(backend=record, **options)
    seq = cfg.data.seq_len
    model.eval()
    with torch.no_grad():
        for seed, rows in enumerate((4, 3)):  # a full evaluation batch, then the short last one
            model(_batch(rows, seq, seed), labels=_batch(rows, seq, seed))
    model.train()
    model(_batch(4, seq, 7), labels=_batch(4, seq, 7))["loss"].backward()
    assert len(inputs) == 3  # evaluation at 4 rows, at 3 rows, training
    symbolic = [[type(x).__name__ for x in graph if not isinstance(x, torch.Tensor)] for graph in inputs]
    assert symbolic == [[], [], []], symbolic
