"""TTLinear: a linear layer whose weight lives only as gated TT cores.

``W (N_in, N_out) = G_1 diag(m(g_1)) G_2 ... G_D`` (method doc section 1-2), ``y = x W + b``.
The forward asks the cost model (``tensor.cost``) for the cheapest contraction order at the
current token count; the bidirectional order runs through ``kernels.dispatch.tt_linear``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from comera_dist.kernels import dispatch
from comera_dist.layers.base import TensorizedModule
from comera_dist.tensor import accounting, contract
from comera_dist.tensor.cost import ORDERS, choose_order
from comera_dist.tensor.factorize import check_modes, check_ranks, factorize, tt_ranks
from comera_dist.tensor.smallops import on_one_thread
from comera_dist.tensor.tt import tt_init, tt_svd, tt_to_dense


class TTLinear(TensorizedModule):
    """``nn.Linear`` replacement; weight stored as ``len(in_modes) + len(out_modes)`` TT cores.

    Modes default to ``factorize(in_features, ceil(num_cores/2))`` (descending) for the input and
    the reversed factorization of ``out_features`` into the rest, which gives the paper's modes
    (768x768, 6 cores -> [12,8,8 / 8,8,12]). ``ranks`` (full profile, ends 1) overrides the capped
    ``tt_ranks(modes, max_rank)``, so a pruned model can be rebuilt. ``order`` forces a contraction
    order (``lr`` | ``sequential`` | ``dense``) instead of ``auto`` (the cost model).
    """

    def __init__(self, in_features: int, out_features: int, *, in_modes: list[int] | None = None,
                 out_modes: list[int] | None = None, num_cores: int = 6, max_rank: int = 30,
                 ranks: list[int] | None = None, bias: bool = True, tau: float = 1e-2,
                 init_std: float | None = None, order: str = "auto", dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, generator: torch.Generator | None = None) -> None:
        super().__init__()
        _check_pos("in_features", in_features)
        _check_pos("out_features", out_features)
        if not isinstance(num_cores, int) or isinstance(num_cores, bool) or num_cores < 2:
            raise ValueError(f"num_cores must be an int >= 2, got {num_cores!r}")
        d_in = (num_cores + 1) // 2 if in_modes is None else len(in_modes)
        if out_modes is None and num_cores <= d_in:  # the output side would get num_cores - d_in <= 0 cores
            raise ValueError(f"num_cores={num_cores} leaves no output core after in_modes={in_modes} ({d_in} cores): "
                             f"pass num_cores >= {d_in + 1} or out_modes")
        self.in_modes = factorize(in_features, d_in) if in_modes is None else \
            check_modes("in_modes", in_modes, in_features)
        self.out_modes = factorize(out_features, num_cores - d_in)[::-1] if out_modes is None else \
            check_modes("out_modes", out_modes, out_features)
        self.in_features, self.out_features = in_features, out_features
        modes = self.in_modes + self.out_modes
        caps = tt_ranks(modes, 10**9)
        if ranks is None:
            ranks = tt_ranks(modes, max_rank)
        ranks = check_ranks("ranks", ranks, len(modes), caps)
        if init_std is None:
            init_std = math.sqrt(1.0 / (in_features + out_features))
        dtype = dtype or torch.get_default_dtype()
        self._init_state(tt_init(self.in_modes, self.out_modes, ranks, init_std, generator, dtype, device), tau)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        self.order = order

    @property
    def order(self) -> str:
        """``auto`` (cost model) or a forced order name."""
        return self._order

    @order.setter
    def order(self, value: str) -> None:
        if value != "auto" and value not in ORDERS:
            raise ValueError(f"order must be 'auto' or one of {list(ORDERS)}, got {value!r}")
        self._order = value

    @property
    def d(self) -> int:
        """Number of input-side cores."""
        return len(self.in_modes)

    # ---- conversion ------------------------------------------------------------------------

    @classmethod
    def from_dense(cls, weight: Tensor, bias: Tensor | None = None, *, max_rank: int, num_cores: int = 6,
                   **kwargs: Any) -> TTLinear:
        """TT-SVD of ``weight (N_in, N_out)`` (``y = x W + b``); exact when ``max_rank`` reaches the caps."""
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D (N_in, N_out), got shape {tuple(weight.shape)}")
        w = weight.detach()
        layer = cls(w.shape[0], w.shape[1], max_rank=max_rank, num_cores=num_cores, bias=bias is not None,
                    dtype=w.dtype, device=w.device, **kwargs)
        cores = tt_svd(w, layer.in_modes, layer.out_modes, max_rank, ranks=layer.full_ranks(active=False))
        with torch.no_grad():
            for p, c in zip(layer.cores, cores):
                p.copy_(c)
            if bias is not None:
                layer.bias.copy_(bias.detach())
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, max_rank: int, num_cores: int = 6, **kwargs: Any) -> TTLinear:
        """TT-SVD of ``linear.weight.T``; exact when ``max_rank`` reaches the rank caps."""
        return cls.from_dense(linear.weight.T, linear.bias, max_rank=max_rank, num_cores=num_cores, **kwargs)

    def to_dense(self) -> Tensor:
        """The masked dense weight ``(N_in, N_out)`` (tests, export; never used by ``forward``)."""
        return tt_to_dense(self.core_list(), self.masked_gates(), self.d)

    def dense_weight(self) -> Tensor:
        """Alias of ``to_dense()``."""
        return self.to_dense()

    @torch.no_grad()
    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` with the densified (masked) weight."""
        w = self.dense_weight()
        out = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, dtype=w.dtype,
                        device=w.device)
        out.weight.copy_(w.T)
        if self.bias is not None:
            out.bias.copy_(self.bias)
        return out

    # ---- forward -------------------------------------------------------------------------------

    def forward(self, x: Tensor, factors: tuple[Tensor, Tensor] | None = None, *, gelu_input: bool = False) -> Tensor:
        """x: (..., in_features) -> (..., out_features).

        factors: this layer's ``(L, R)`` already contracted by the caller (``layers.group.
        shared_factors`` contracts same-shape layers together); then the ``lr`` order runs
        whatever the token count, since the factors are paid for.
        gelu_input: the layer of ``gelu(x)``; in the ``lr`` order GELU is fused into ``x L``
        (``contract.tt_linear_lr_gelu``, which bypasses ``kernels.dispatch``), so autograd keeps
        ``x`` alone.
        """
        self.check_input(x)
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)  # (T, N_in)
        order = "lr" if factors is not None else \
            self.chosen_order(x2d.shape[0], _activation_bytes(x2d), gelu_input=gelu_input)
        if order == "lr":
            L, R = factors if factors is not None else \
                on_one_thread(self._halves, self.core, self.gate)  # (N_in, r_d), (r_d, N_out)
            y = contract.tt_linear_lr_gelu(x2d, L, R, self.bias) if gelu_input else \
                dispatch.tt_linear(x2d, L, R, self.bias)  # (T, N_out)
        else:
            if gelu_input:
                x2d = F.gelu(x2d)
            if order == "sequential":
                cores = self.core_list()
                y = contract.tt_linear_sequential(x2d, cores, self.masked_gates(), self.d)  # (T, N_out)
            else:
                W, = on_one_thread(lambda c, g: (tt_to_dense(self.split_cores(c), self._mask(g), self.d),),
                                   self.core, self.gate)
                y = x2d @ W  # (T, N_out)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)  # an fp32 bias must not promote a bf16 (autocast) output
        return y.reshape(*lead, self.out_features)

    def check_input(self, x: Tensor) -> None:
        """``x``'s last dim must be ``in_features`` (also for callers that apply the factors themselves,
        ``layers.group.project_shared_input``)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input last dim is {x.shape[-1]}, TTLinear expects in_features={self.in_features}")

    def _halves(self, core: Tensor, gate: Tensor) -> tuple[Tensor, Tensor]:
        """``L`` (middle mask folded in) and ``R`` from the flat cores and the gate vector (the batch-independent
        part), zero-padded to the aligned middle rank (``kernels.dispatch.pad_rank``) as a group's are."""
        d = self.d
        cores, masks = self.split_cores(core), self._mask(gate)
        return dispatch.pad_rank(contract.contract_left(cores[:d], masks[:d]), contract.contract_right(cores[d:], masks[d:]))

    def chosen_order(self, tokens: int, bytes_per_element: int = 4, *, gelu_input: bool = False) -> str:
        """The contraction order ``forward`` uses for ``tokens`` tokens of ``bytes_per_element``-byte
        activations (2 under bf16: the saved activations weigh half as much), with or without the
        fused input GELU (only ``lr`` fuses it; ``dense`` also keeps ``gelu(x)``)."""
        if self._order != "auto":
            return self._order
        return choose_order(tokens, self.in_modes, self.out_modes, self.full_ranks(active=False),
                            bytes_per_element=bytes_per_element, gelu_input=gelu_input).name

    # ---- accounting ----------------------------------------------------------------------------

    def param_count(self, active: bool = True) -> int:
        """Core parameters with active (``g > tau``) or physical ranks; bias not included."""
        return accounting.tt_params(self.in_modes + self.out_modes, self.full_ranks(active))

    def dense_param_count(self) -> int:
        """Parameters of the dense weight this layer replaces (bias not included)."""
        return self.in_features * self.out_features

    def flops_per_token(self, active: bool = True, tokens: int = 4096) -> int:
        """Per-token forward FLOPs of the order chosen for ``tokens`` tokens (build cost excluded)."""
        order = self.chosen_order(tokens)
        return accounting.tt_flops_per_token(self.in_modes, self.out_modes, self.full_ranks(active), order)

    def tensor_shapes(self) -> dict[str, Any]:
        """What rebuilds this layer's shapes: ``TTLinear(in, out, **shapes)``."""
        return {"in_modes": list(self.in_modes), "out_modes": list(self.out_modes),
                "ranks": self.full_ranks(active=False)}

    def extra_repr(self) -> str:
        return (f"{self.in_features}, {self.out_features}, in_modes={self.in_modes}, out_modes={self.out_modes}, "
                f"ranks={self.full_ranks(active=False)}, bias={self.bias is not None}")


def _check_pos(name: str, v: object) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")


def _activation_bytes(x: Tensor) -> int:
    """Bytes per element of the activations autograd saves: autocast's dtype when it is on."""
    if x.is_floating_point() and x.device.type in ("cpu", "cuda") and torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type).itemsize
    return x.element_size()
