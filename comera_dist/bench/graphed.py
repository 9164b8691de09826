"""The whole training step in one CUDA graph: forward, backward and the AdamW step, replayed.

CoMERA's step is launch-bound on a GPU: thousands of tiny kernels (the TT contractions of 37
layers) whose launch cost dwarfs their math, so batch 1 costs as much as batch 32. The paper's
own GPU optimisation captures the step once and replays it; this is that capture, with the
recipe of PyTorch's "whole network capture" (``torch.cuda.graph``):

- warm-up steps on a side stream first (they allocate the optimizer state and let cuBLAS/cuDNN
  pick their algorithms outside the capture), then the capture on that same stream;
- gradients set to None before the capture, so the captured backward *assigns* them (a replay
  does not accumulate into the last step's gradients) and they stay alive as static buffers the
  captured optimizer step reads;
- the optimizer must be ``capturable`` (its step counts live on the device);
- autocast's weight-cast cache is off (a cached cast would be a stale tensor at replay);
- the batch lives in static buffers: a replay reads whatever was copied into them.

Dropout draws from the default CUDA generator, which PyTorch registers with the graph (each
replay advances the Philox offset, so masks differ per step as in eager mode). Nothing in the step
may read a device value on the host: a capture fails loudly on the first host sync. After a
physical prune (new shapes, new parameters) the graph is stale: build a new ``GraphedStep``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


class GraphedStep:
    """``step(batch)``: copy ``batch`` into the static buffers and replay the captured step.

    ``loss_fn(batch) -> Tensor`` is the forward (and the objective); ``optimizer`` updates the
    parameters it was built over and must have been created with ``capturable=True``.
    ``autocast`` (e.g. ``torch.bfloat16``) runs the forward under autocast with the cast cache off.
    """

    def __init__(self, loss_fn: Callable[[dict[str, Tensor]], Tensor], optimizer: torch.optim.Optimizer,
                 batch: dict[str, Tensor], *, autocast: torch.dtype | None = None, warmup: int = 3) -> None:
        if not all(t.is_cuda for t in batch.values()):
            raise ValueError("GraphedStep captures a CUDA graph: every batch tensor must be on a CUDA device")
        if not all(g.get("capturable", False) for g in optimizer.param_groups):
            raise ValueError("GraphedStep: the optimizer must be built with capturable=True "
                             "(its step counts must live on the device to be captured)")
        self.loss_fn, self.optimizer, self.autocast = loss_fn, optimizer, autocast
        self.static = {k: v.detach().clone() for k, v in batch.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._eager()
                self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.current_stream().wait_stream(side)
        self.optimizer.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        # one stream for warm-up and capture: cuBLAS allocates a workspace per stream (65 MiB on the H200)
        with torch.cuda.graph(self.graph, stream=side):
            self.loss = self._eager()

    def _eager(self) -> Tensor:
        """One forward + backward + optimizer step on the static batch; the loss stays on the device."""
        with torch.autocast("cuda", dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None,
                            cache_enabled=False):
            loss = self.loss_fn(self.static)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def step(self, batch: dict[str, Tensor]) -> Tensor:
        """Replay on ``batch`` (same keys, shapes and dtypes as at capture); the loss, on the device."""
        for k, buf in self.static.items():
            src = batch[k]
            if src.shape != buf.shape or src.dtype != buf.dtype:
                raise ValueError(f"GraphedStep: batch[{k!r}] is {tuple(src.shape)} {src.dtype}, the graph was "
                                 f"captured for {tuple(buf.shape)} {buf.dtype}; capture a new graph")
            buf.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.loss
