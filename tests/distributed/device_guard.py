"""``DeviceGuard``: catches, on a CPU-only machine, the device mistakes that crash a GPU run.

On CPU every tensor lands on the accelerator's device (``cpu``) whether or not the code asks
for it, so a plain device comparison can never fail here. The guard checks *provenance*
instead, with a ``TorchFunctionMode`` that watches every torch call of the process:

* **Collectives.** A tensor that our package (``comera_dist``) builds with a factory
  (``torch.tensor``, ``zeros``, ...) without an explicit ``device=``, or brings to the host with
  ``.cpu()``, is tainted, and so is
  everything computed from it, until an explicit ``.to(device)``. Every
  ``torch.distributed`` collective (which ``deepspeed.comm`` calls underneath) is wrapped and
  raises on a tainted tensor, or on one whose device is not the accelerator's. This is exactly
  the ``torch.tensor(values)`` that NCCL refused.
* **Batches.** Every tensor a test hands to the session is marked "host". The top-level model's
  ``forward`` is wrapped and raises on any input that did not pass through an explicit
  ``.to(<engine device>)`` (the batch mover's move), i.e. a batch that would have stayed on
  the CPU while the module sits on ``cuda:0``.

The guard records violations instead of only raising (a raise inside a collective would hang the
peer rank): ``violations`` is checked by the test after the run.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.arange,
             torch.scalar_tensor, torch.randn, torch.rand}
MOVES = {torch.Tensor.to, torch.Tensor.cuda}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "reduce", "all_to_all_single", "gather", "scatter")
TAINT = "_comera_no_device"
MOVED = "_comera_moved_to"
HOST = "_comera_host_batch"


def _ours(frame) -> bool:
    return frame is not None and "comera_dist" in frame.f_code.co_filename


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _explicit_device(func, args, kwargs) -> torch.device | None:
    if "device" in kwargs and kwargs["device"] is not None:
        return torch.device(kwargs["device"])
    if func in MOVES:
        for a in args[1:]:
            if isinstance(a, (str, torch.device)):
                return torch.device(a)
            if isinstance(a, torch.Tensor):
                return a.device
        return torch.device("cuda") if func is torch.Tensor.cuda else None
    return None


class DeviceGuard(TorchFunctionMode):
    """Enter around session calls (``with guard:``); then ``watch_model`` and ``host`` the batches."""

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.violations: list[str] = []
        self.collective_calls = 0
        self.forward_calls = 0
        self._saved: dict[str, Any] = {}

    # ---- provenance -------------------------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        explicit = _explicit_device(func, args, kwargs)
        outs = _tensors(out)
        if func is torch.Tensor.cpu and _ours(sys._getframe(1)):  # names the host: wrong for NCCL
            for t in outs:
                setattr(t, TAINT, f"cpu() at {_where(sys._getframe(1))}")
        elif func in FACTORIES:
            if explicit is None and _ours(sys._getframe(1)):
                for t in outs:
                    setattr(t, TAINT, f"{getattr(func, '__name__', func)} at {_where(sys._getframe(1))}")
        elif func in MOVES and explicit is not None:
            for t in outs:
                setattr(t, MOVED, str(t.device))
                if hasattr(t, TAINT):
                    delattr(t, TAINT)
        else:
            sources = [getattr(t, TAINT) for t in _tensors((args, kwargs)) if hasattr(t, TAINT)]
            if sources:
                for t in outs:
                    if not isinstance(t, torch.nn.Parameter):
                        setattr(t, TAINT, sources[0])
        return out

    def host(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Mark a batch as host data (what the loader yields), fresh tensors so no mark is stale."""
        out = {}
        for k, v in batch.items():
            v = v.clone()
            setattr(v, HOST, True)
            out[k] = v
        return out

    # ---- the checks -------------------------------------------------------------------------
    def _check_collective(self, name: str, args, kwargs) -> None:
        self.collective_calls += 1
        for t in _tensors((args, kwargs)):
            if hasattr(t, TAINT):
                self.violations.append(f"{name}: tensor built without a device ({getattr(t, TAINT)})")
            elif t.device != self.device:
                self.violations.append(f"{name}: tensor on {t.device}, the accelerator is {self.device}")

    def _check_forward(self, model_name: str, args, kwargs) -> None:
        self.forward_calls += 1
        for key, t in [*enumerate(args), *kwargs.items()]:
            if not isinstance(t, torch.Tensor):
                continue
            if getattr(t, MOVED, None) != str(self.device) or t.device != self.device:
                self.violations.append(f"{model_name}.forward({key}): input on {t.device} was never moved to "
                                       f"{self.device} (host batch: {hasattr(t, HOST)})")

    @contextmanager
    def installed(self, model_cls: type) -> Iterator[DeviceGuard]:
        """Wrap the collectives and ``model_cls.forward`` and enter the mode."""
        guard = self
        originals = {n: getattr(dist, n) for n in COLLECTIVES}

        def wrap(name, fn):
            def checked(*args, **kwargs):
                guard._check_collective(name, args, kwargs)
                return fn(*args, **kwargs)
            return checked

        forward = model_cls.forward

        def checked_forward(module, *args, **kwargs):
            guard._check_forward(model_cls.__name__, args, kwargs)
            return forward(module, *args, **kwargs)

        for n, fn in originals.items():
            setattr(dist, n, wrap(n, fn))
        model_cls.forward = checked_forward
        try:
            with self:
                yield self
        finally:
            model_cls.forward = forward
            for n, fn in originals.items():
                setattr(dist, n, fn)


def _where(frame) -> str:
    return f"{frame.f_code.co_filename.rsplit('comera_dist', 1)[-1]}:{frame.f_lineno}"
