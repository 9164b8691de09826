"""The dense linear layer of the native models: ``nn.Linear`` that can apply GELU to its input itself.

``Linear(x, gelu_input=True)`` is ``nn.Linear(gelu(x))`` through ``tensor.fused.gelu_matmul``:
autograd keeps ``x`` only, not ``gelu(x)`` as well. The FFN's out-projection uses it, the same way
it uses ``TTLinear(..., gelu_input=True)``, so the dense and GaLore baselines save what CoMERA
saves there. Parameters, state dict and ``isinstance(m, nn.Linear)`` are ``nn.Linear``'s; the
call stays the module's own forward, where ZeRO-3 gathers the weight. A ZeRO-3-partitioned weight
takes the unfused path (``F.gelu``, then DeepSpeed's linear, which saves the parameter itself).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from comera_dist.tensor.fused import gelu_matmul


class Linear(nn.Linear):
    """``nn.Linear`` with an optional fused input GELU."""

    def forward(self, x: Tensor, *, gelu_input: bool = False) -> Tensor:
        """x: (..., in_features) -> (..., out_features); ``gelu_input``: apply GELU to ``x`` first."""
        if not gelu_input:
            return super().forward(x)
        if hasattr(self.weight, "ds_id"):
            # ZeRO-3 frees the gathered weight after this forward; a saved view of it (``weight.T``)
            # would keep it alive until backward. DeepSpeed's own linear saves the parameter instead.
            return super().forward(F.gelu(x))
        y = gelu_matmul(x.reshape(-1, self.in_features), self.weight.T, self.bias)  # (T, out)
        return y.reshape(*x.shape[:-1], self.out_features)
