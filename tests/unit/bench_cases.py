"""Shared by the tests that compare two runs of a ``bench.six_encoder`` contender step for step."""

from __future__ import annotations

import torch

from comera_dist.bench import six_encoder


def no_dropout(c: six_encoder.Contender) -> six_encoder.Contender:
    """``c`` with every dropout off, so two runs compared step for step draw the same (no) masks."""
    for m in c.model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        elif isinstance(getattr(m, "dropout", None), float):
            m.dropout = 0.0  # attention's dropout_p (blocks.py): missed once, it made the first H200 run red
    return c
