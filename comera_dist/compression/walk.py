"""Finding the tensorized layers of a model (the one place compression/ knows the layer base class)."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from comera_dist.layers.base import TensorizedModule


def tensorized_modules(model: nn.Module) -> Iterator[tuple[str, TensorizedModule]]:
    """Yield ``(qualified_name, layer)`` for every TT/TTM layer in ``model``, in module order.

    The name is the ``named_modules`` name ("" when ``model`` itself is tensorized); it is
    the key of pruning plans and of the per-layer rows of the compression report.
    """
    for name, module in model.named_modules():
        if isinstance(module, TensorizedModule):
            yield name, module
