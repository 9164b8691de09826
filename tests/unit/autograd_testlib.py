"""Test helper: what autograd keeps for backward, measured with saved-tensor hooks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def saved_storages(fn: Callable[[], Any]) -> tuple[Any, dict[int, int]]:
    """Run ``fn()``; returns its result and ``{storage data_ptr: storage bytes}`` of every tensor autograd saved
    meanwhile (a storage saved twice, or through views, counts once)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, seen
