"""The dense linear layer of the native models: ``nn.Linear`` that can apply GELU to its input itself.

``Linear(x, gelu_input=True)`` is ``nn.Linear(gelu(x))`` through ``tensor.fused.gelu_matmul``:
autograd keeps ``x`` only, not ``gelu(x)`` as well. The FFN's out-projection uses it, the same way
it uses ``TTLinear(..., gelu_input=True)``, so the dense and GaLore baselines save what CoMERA
saves there. Parameters, state dict and ``isinstance(m, nn.Linear)`` are ``nn.Linear``'s; the
call stays the module's own forward, where ZeRO-3 gathers the weight.
"""

from __future__ import annotations

from torch import Tensor, nn

from comera_dist.tensor.fused import gelu_matmul


class Linear(nn.Linear):
    """``nn.Linear`` with an optional fused input GELU."""

    def forward(self, x: Tensor, *, gelu_input: bool = False) -> Tensor:
        """x: (..., in_features) -> (..., out_features); ``gelu_input``: apply GELU to ``x`` first."""
        if not gelu_input:
            return super().forward(x)
        y = gelu_matmul(x.reshape(-1, self.in_features), self.weight.T)  # (T, out)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)  # an fp32 bias must not promote a bf16 (autocast) output
        return y.reshape(*x.shape[:-1], self.out_features)
