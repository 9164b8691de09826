"""Batch collators: MLM masking (80/10/10) and causal LM, deterministic given each block's key.

A collator is ``collate(input_ids (B, L) int64, keys (B,) uint64) -> dict(input_ids, labels, ...)``, both
``(B, L)`` int64; ignored label positions are ``-100``. The MLM collator adds ``mlm_positions``
``(B, P)``: a fixed number of positions per row holding every label, so the model runs its head
and loss on those rows only (static shapes, no host sync). ``keys`` name the blocks
(``noise.block_keys``): a row's masks are a function of its key alone (``noise.uniform``), whatever
rank, batch or world size collates it.

There is no ``attention_mask``: packed blocks hold no padding, and an all-ones mask would make
the models build a ``(B, 1, T, T)`` boolean mask, which keeps SDPA off its flash and
memory-efficient kernels. A caller with real padding passes its own mask to the model.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from comera_dist.data.errors import DataError
from comera_dist.data.noise import uniform

IGNORE_INDEX = -100
"""Label of positions that carry no loss (the ``ignore_index`` of ``F.cross_entropy``)."""

Collator = Callable[[Tensor, np.ndarray], dict[str, Tensor]]


def mlm_collator(tokenizer: PreTrainedTokenizerBase, mlm_probability: float = 0.15) -> Collator:
    """BERT masking: select ``P = max(1, round(mlm_probability * L))`` non-special tokens per row
    (fewer where a row has fewer), uniformly without replacement, as BERT's own data builder does;
    of those 80% become ``[MASK]``, 10% a random non-special token, 10% stay; labels hold the
    originals there only. ``mlm_positions`` (B, P), ascending, lists the selected positions (padded
    with unselected ones, whose label is ``-100``, in a row with fewer than P eligible tokens).

    A fixed count per row instead of an independent draw per token keeps the shapes static: the
    MLM head and its cross-entropy run on (B, P) rows instead of (B, L), about 1/7 of the logits at
    the usual 15%, without a data-dependent selection (a host sync) in the model.
    """
    if not 0.0 < mlm_probability < 1.0:
        raise DataError(f"mlm_probability must be in (0, 1), got {mlm_probability}")
    if tokenizer.mask_token_id is None:
        raise DataError(f"MLM needs a mask token; {type(tokenizer).__name__} has none")
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
    vocab = len(tokenizer)
    ordinary = torch.tensor([i for i in range(vocab) if i not in set(special.tolist())], dtype=torch.long)
    mask_id = tokenizer.mask_token_id

    def collate(input_ids: Tensor, keys: np.ndarray) -> dict[str, Tensor]:
        ids = input_ids.long()  # (B, L)
        _check_keys(keys, ids)
        length = ids.shape[1]
        eligible = ~torch.isin(ids, special)  # (B, L)
        count = max(1, round(mlm_probability * length))  # P
        order = uniform(keys, length, 0).masked_fill(~eligible, 2.0)  # (B, L): ineligible sort last
        positions = order.argsort(dim=1)[:, :count].sort(dim=1).values  # (B, P) a random P-subset, ascending
        selected = torch.zeros_like(eligible).scatter_(1, positions, True) & eligible  # (B, L)
        labels = torch.where(selected, ids, IGNORE_INDEX)  # (B, L)
        draw = uniform(keys, length, 1)  # (B, L): one draw decides 80/10/10
        to_mask = selected & (draw < 0.8)
        to_random = selected & (draw >= 0.8) & (draw < 0.9)
        pick = (uniform(keys, length, 2) * len(ordinary)).long().clamp_(max=len(ordinary) - 1)  # (B, L)
        random_ids = ordinary[pick]
        out = torch.where(to_mask, mask_id, ids)
        out = torch.where(to_random, random_ids, out)
        return {"input_ids": out, "labels": labels, "mlm_positions": positions}

    return collate


def causal_collator() -> Collator:
    """Causal LM: labels are the inputs unshifted (the model shifts, as HF causal models do)."""

    def collate(input_ids: Tensor, keys: np.ndarray) -> dict[str, Tensor]:
        ids = input_ids.long()  # (B, L)
        _check_keys(keys, ids)
        return {"input_ids": ids, "labels": ids.clone()}

    return collate


def collator_for(objective: str, tokenizer: PreTrainedTokenizerBase, mlm_probability: float = 0.15) -> Collator:
    """The collator of ``objective`` (``mlm`` or ``causal``)."""
    if objective == "mlm":
        return mlm_collator(tokenizer, mlm_probability)
    if objective == "causal":
        return causal_collator()
    raise DataError(f"data.objective must be 'mlm' or 'causal', got {objective!r}")


def _check_keys(keys: np.ndarray, ids: Tensor) -> None:
    if ids.ndim != 2 or np.shape(keys) != (ids.shape[0],):
        raise DataError(f"a collator takes blocks (B, L) and one key per block (B,); got blocks {tuple(ids.shape)} "
                        f"and keys {np.shape(keys)}")
