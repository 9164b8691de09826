"""Deterministic per-rank batches over packed blocks: an endless, exactly resumable iterator.

Epoch ``e`` visits the blocks in the order ``perm_e`` (a permutation drawn from ``(seed, e)``,
the same on every rank). The epoch is consumed in global batches of ``batch_size * world_size``
blocks; rank ``r`` takes the ``r``-th slice of ``batch_size`` of each, so ranks never share a
block within an epoch. The state is (epoch, position = blocks of the epoch consumed by all ranks,
step = batches yielded), which does not depend on the world size: a run resumed on a different
number of ranks continues with the same unseen blocks, re-sliced.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import datasets
import numpy as np
import torch
from torch import Tensor

from comera_dist.data.collators import Collator, batch_seed
from comera_dist.data.errors import DataError


class PackedLoader:
    """Endless iterator of collated batches ``dict(input_ids, attention_mask, labels)``, each ``(B, L)``."""

    def __init__(self, dataset: datasets.Dataset, *, batch_size: int, rank: int, world_size: int, seed: int,
                 collator: Collator, drop_last: bool = True) -> None:
        """``drop_last=False`` completes an epoch's last global batch with blocks from the start of the
        same epoch's order (seen twice), so every rank still gets full, equally many batches."""
        _check(batch_size >= 1, f"batch_size must be >= 1, got {batch_size}")
        _check(world_size >= 1 and 0 <= rank < world_size, f"rank={rank} not in [0, world_size={world_size})")
        global_batch = batch_size * world_size
        _check(len(dataset) >= global_batch, f"the dataset has {len(dataset)} blocks, fewer than one global "
                                             f"batch (batch_size {batch_size} x world_size {world_size})")
        self.dataset = dataset.with_format("numpy", columns=["input_ids"])
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.collator, self.drop_last = collator, drop_last
        self.epoch, self.position, self.step = 0, 0, 0
        self._perm: tuple[int, Tensor] | None = None

    @property
    def batches_per_epoch(self) -> int:
        """Batches each rank gets per full epoch."""
        n, g = len(self.dataset), self.batch_size * self.world_size
        return n // g if self.drop_last else -(-n // g)

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        return self

    def __next__(self) -> dict[str, Tensor]:
        n, g = len(self.dataset), self.batch_size * self.world_size
        if self.position >= n or (self.drop_last and self.position + g > n):
            self.epoch, self.position = self.epoch + 1, 0
        order = self._order(self.epoch)  # (n,)
        ids = order[self.position:self.position + g]  # (<= g,)
        if len(ids) < g:  # drop_last=False: wrap around to the start of this epoch's order
            ids = torch.cat([ids, order[:g - len(ids)]])
        mine = ids[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]  # (B,)
        blocks = torch.from_numpy(self.dataset[mine.numpy()]["input_ids"].astype(np.int64))  # (B, L)
        gen = torch.Generator().manual_seed(batch_seed(self.seed, self.step, self.rank))
        self.position += g
        self.step += 1
        return self.collator(blocks, gen)

    def state_dict(self) -> dict[str, Any]:
        """Where the iteration stands (plain ints), to be saved in a checkpoint."""
        return {"epoch": self.epoch, "position": self.position, "step": self.step, "seed": self.seed,
                "num_blocks": len(self.dataset)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly after the last batch of the saved run (the world size may differ)."""
        missing = {"epoch", "position", "step", "seed", "num_blocks"} - set(state)
        _check(not missing, f"loader state lacks {sorted(missing)}")
        _check(state["seed"] == self.seed, f"loader state has seed {state['seed']}, this loader {self.seed}")
        _check(state["num_blocks"] == len(self.dataset),
               f"loader state was saved over {state['num_blocks']} blocks, this dataset has "
               f"{len(self.dataset)} (a different corpus, tokenizer or seq_len)")
        self.epoch, self.position, self.step = int(state["epoch"]), int(state["position"]), int(state["step"])

    def _order(self, epoch: int) -> Tensor:
        if self._perm is None or self._perm[0] != epoch:
            gen = torch.Generator().manual_seed(batch_seed(self.seed, epoch, -1))
            self._perm = (epoch, torch.randperm(len(self.dataset), generator=gen))
        return self._perm[1]


def eval_batches(dataset: datasets.Dataset, *, batch_size: int, rank: int, world_size: int, seed: int,
                 collator: Collator, max_batches: int | None = None) -> Iterator[dict[str, Tensor]]:
    """One pass over this rank's contiguous shard, in order, with masks fixed by ``seed``.

    Every rank yields the same number of batches (the last ``len % world_size`` blocks are left
    out, and the final batch may be short), as ZeRO-3 forwards are collective. The same seed
    gives the same masks at every evaluation, so successive validation losses are comparable.
    """
    _check(batch_size >= 1, f"batch_size must be >= 1, got {batch_size}", who="eval_batches")
    _check(world_size >= 1 and 0 <= rank < world_size, f"rank={rank} not in [0, world_size={world_size})",
           who="eval_batches")
    per_rank = len(dataset) // world_size
    _check(per_rank >= 1, f"the evaluation set has {len(dataset)} blocks, fewer than world_size={world_size}",
           who="eval_batches")
    data = dataset.with_format("numpy", columns=["input_ids"])
    starts = range(rank * per_rank, (rank + 1) * per_rank, batch_size)
    for i, start in enumerate(starts):
        if max_batches is not None and i >= max_batches:
            return
        stop = min(start + batch_size, (rank + 1) * per_rank)
        blocks = torch.from_numpy(data[start:stop]["input_ids"].astype(np.int64))  # (b, L)
        yield collator(blocks, torch.Generator().manual_seed(batch_seed(seed, i, rank)))


def _check(ok: bool, message: str, who: str = "PackedLoader") -> None:
    if not ok:
        raise DataError(f"{who}: {message}")
