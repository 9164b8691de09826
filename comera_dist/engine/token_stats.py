"""Token-level evaluation sums shared by in-training evaluation and checkpoint evaluation."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from comera_dist.data.collators import IGNORE_INDEX


@torch.no_grad()
def label_token_sums(forward: Callable[..., Mapping[str, Any]], batches: Iterable[Mapping[str, Any]], *,
                     causal: bool) -> tuple[float, float, float]:
    """``(loss x tokens, arg-max hits, tokens)`` summed over the label tokens of ``batches``.

    Label tokens are the positions whose label is not ``IGNORE_INDEX`` (MLM: masked positions;
    causal: next tokens, so logits and labels are shifted by one). The model's ``loss`` is a mean
    over those tokens, hence the weighting by their count.
    """
    loss_sum, correct, count = 0.0, 0.0, 0.0
    for batch in batches:
        out = forward(**batch)
        logits, labels = out["logits"], batch["labels"]  # (B, T, V), (B, T)
        if batch.get("mlm_positions") is not None:  # the model's logits are at those positions only
            labels = labels.gather(1, batch["mlm_positions"])  # (B, P)
        if causal:
            logits, labels = logits[:, :-1], labels[:, 1:]
        keep = labels != IGNORE_INDEX  # (B, T)
        n = float(keep.sum())
        loss_sum += float(out["loss"]) * n if n else 0.0  # a batch of no label token (a filler) has a NaN mean
        correct += float((logits.argmax(-1) == labels)[keep].sum())
        count += n
    return loss_sum, correct, count
