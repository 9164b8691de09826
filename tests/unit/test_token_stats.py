"""label_token_sums: loss x tokens, hits and tokens over the label tokens, a batch without one counting nothing."""

import math

import torch
import torch.nn.functional as F

from comera_dist.data import IGNORE_INDEX
from comera_dist.engine.token_stats import label_token_sums

V = 7


def _forward(input_ids, labels):
    """A model's contract: logits (B, T, V) and the mean cross-entropy over the label tokens (NaN when none)."""
    logits = torch.nn.functional.one_hot(input_ids % V, V).double() * 2.0  # (B, T, V)
    return {"logits": logits, "loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)}


def test_sums_weight_each_batch_by_its_label_tokens_and_a_filler_adds_nothing():
    ids = torch.arange(12).reshape(2, 6)  # (B, T)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[0, 1], labels[1, 3], labels[1, 4] = 1 % V, 3, 0  # hit (1 % 7 == 1), miss (9 % 7 != 3), miss
    filler = {"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX)}
    assert math.isnan(float(_forward(**filler)["loss"]))  # what a filler's forward gives
    loss_sum, correct, count = label_token_sums(_forward, [{"input_ids": ids, "labels": labels}, filler],
                                                causal=False)
    keep = labels != IGNORE_INDEX
    logits = _forward(ids, labels)["logits"]
    expected = float(F.cross_entropy(logits[keep], labels[keep], reduction="sum"))
    assert (count, correct) == (3.0, 1.0) and math.isclose(loss_sum, expected, rel_tol=1e-12)
