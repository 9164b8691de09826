"""Deterministic per-rank batches over packed blocks: an endless, exactly resumable iterator.

Epoch ``e`` visits the blocks in the order ``perm_e`` (a permutation drawn from ``(seed, e)``,
the same on every rank). The epoch is consumed in global batches of ``batch_size * world_size``
blocks; rank ``r`` takes the ``r``-th slice of ``batch_size`` of each, so ranks never share a
block within an epoch. The state is (epoch, position = blocks of the epoch consumed by all ranks,
step = batches yielded), which does not depend on the world size: a run resumed on a different
number of ranks continues with the same unseen blocks, re-sliced. A block's masks are keyed by
(seed, epoch, its slot in the epoch's order) (``noise.block_keys``), so they too are the same at any
world size: two ranks with one micro-batch each and one rank accumulating two see the same batch.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import datasets
import numpy as np
import torch
from torch import Tensor

from comera_dist.data.collators import IGNORE_INDEX, Collator
from comera_dist.data.errors import DataError
from comera_dist.data.noise import EVAL_EPOCH, batch_seed, block_keys


def _one_intra_op_thread() -> None:
    """The prefetch thread collates one small batch at a time: it runs torch ops on one intra-op thread.

    The thread count is per OS thread under OpenMP. With the default, the prefetch thread's parallel
    regions get an OpenMP team of their own whose workers spin-wait on every core after each batch
    (libgomp's active wait policy), starving the training thread: the CPU smoke trainer ran at 165
    tokens/s with that, 4,190 without prefetching (``bench trainer-rate --smoke``).
    """
    torch.set_num_threads(1)


class PackedLoader:
    """Endless iterator of collated batches ``dict(input_ids, labels)``, each ``(B, L)``."""

    def __init__(self, dataset: datasets.Dataset, *, batch_size: int, rank: int, world_size: int, seed: int,
                 collator: Collator, drop_last: bool = True, prefetch: bool = False,
                 pin_memory: bool = False) -> None:
        """``drop_last=False`` completes an epoch's last global batch with blocks from the start of the
        same epoch's order (seen twice), so every rank still gets full, equally many batches.

        ``prefetch``: a background thread reads and collates the next batch while the caller trains
        on this one (MLM masking then leaves the main thread, which issues the GPU's kernels). A batch
        is a pure function of the position, so prefetching changes no batch and no ``state_dict``.
        ``pin_memory``: batches come in page-locked host memory (CUDA only), so the engine's
        ``non_blocking`` copy to the GPU is asynchronous."""
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
        self._perm_lock = threading.Lock()
        self.pin_memory = pin_memory
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="comera-prefetch",
                                        initializer=_one_intra_op_thread) if prefetch else None
        self._ahead: tuple[tuple[int, int, int], Future] | None = None  # (state it was made for, batch)

    @property
    def batches_per_epoch(self) -> int:
        """Batches each rank gets per full epoch."""
        n, g = len(self.dataset), self.batch_size * self.world_size
        return n // g if self.drop_last else -(-n // g)

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        return self

    def __next__(self) -> dict[str, Tensor]:
        state = self._start(self.epoch, self.position, self.step)
        if self._ahead is not None and self._ahead[0] == state:
            batch = self._ahead[1].result()
        else:  # no prefetch, or the state moved (load_state_dict): make it here
            batch = self._batch_at(*state)
        self._ahead = None
        self.epoch, self.position, self.step = state[0], state[1] + self.batch_size * self.world_size, state[2] + 1
        if self._pool is not None:
            nxt = self._start(self.epoch, self.position, self.step)
            self._ahead = (nxt, self._pool.submit(self._batch_at, *nxt))
        return batch

    def _start(self, epoch: int, position: int, step: int) -> tuple[int, int, int]:
        """Where the batch at this state starts: the next epoch when the current one is used up."""
        n, g = len(self.dataset), self.batch_size * self.world_size
        if position >= n or (self.drop_last and position + g > n):
            return epoch + 1, 0, step
        return epoch, position, step

    def _batch_at(self, epoch: int, position: int, step: int) -> dict[str, Tensor]:
        """The batch at (epoch, position, step): a pure function of epoch and position, whatever the step and the
        world size (safe on the prefetch thread)."""
        g = self.batch_size * self.world_size
        order = self._order(epoch)  # (n,)
        ids = order[position:position + g]  # (<= g,)
        if len(ids) < g:  # drop_last=False: wrap around to the start of this epoch's order
            ids = torch.cat([ids, order[:g - len(ids)]])
        first = self.rank * self.batch_size
        mine = ids[first:first + self.batch_size]  # (B,)
        blocks = torch.from_numpy(self.dataset[mine.numpy()]["input_ids"].astype(np.int64))  # (B, L)
        # keyed by slot in the epoch's order (a wrapped block's slot is past the end: masks of its own)
        slots = np.arange(position + first, position + first + self.batch_size)
        batch = self.collator(blocks, block_keys(self.seed, epoch, slots))
        if self.pin_memory:
            batch = {k: v.pin_memory() if isinstance(v, Tensor) else v for k, v in batch.items()}
        return batch

    def close(self) -> None:
        """Stop the prefetch thread (it also stops with the process)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._ahead = None, None

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
        with self._perm_lock:  # the prefetch thread and the caller may ask at once
            if self._perm is None or self._perm[0] != epoch:
                gen = torch.Generator().manual_seed(batch_seed(self.seed, epoch, -1))
                self._perm = (epoch, torch.randperm(len(self.dataset), generator=gen))
            return self._perm[1]


def eval_batches(dataset: datasets.Dataset, *, batch_size: int, rank: int, world_size: int, seed: int,
                 collator: Collator, max_blocks: int | None = None) -> Iterator[dict[str, Tensor]]:
    """One validation pass over the first ``max_blocks`` blocks (default: all), shared among the ranks.

    Rank ``r`` takes the ``r``-th of ``world_size`` near-equal contiguous shards, in batches of at most
    ``batch_size``. Every rank yields the same number of batches, as ZeRO-3 forwards are collective: a
    shard shorter than its batches (only at ``batch_size`` 1) ends with its last block again, every label
    ignored, which adds no label token. Masks are keyed by block (``noise.block_keys``), so the ranks
    together see the same blocks with the same masks at any world size: the validation loss is a
    function of the weights, comparable across an elastic resume and with ``comera evaluate``.
    """
    _check(batch_size >= 1, f"batch_size must be >= 1, got {batch_size}", who="eval_batches")
    _check(world_size >= 1 and 0 <= rank < world_size, f"rank={rank} not in [0, world_size={world_size})",
           who="eval_batches")
    _check(max_blocks is None or max_blocks >= 1, f"max_blocks must be >= 1, got {max_blocks}", who="eval_batches")
    n = len(dataset) if max_blocks is None else min(len(dataset), max_blocks)
    _check(n >= world_size, f"the evaluation set has {n} blocks, fewer than world_size={world_size}",
           who="eval_batches")
    data = dataset.with_format("numpy", columns=["input_ids"])
    shard = np.array_split(np.arange(n), world_size)[rank]  # (n/W,) this rank's blocks
    per_rank = math.ceil(math.ceil(n / world_size) / batch_size)  # the longest shard's batches
    for part in np.array_split(shard, per_rank):
        ids = part if len(part) else shard[-1:]  # (b,)
        blocks = torch.from_numpy(data[ids]["input_ids"].astype(np.int64))  # (b, L)
        batch = collator(blocks, block_keys(seed, EVAL_EPOCH, ids))
        if not len(part):  # a filler: its forward keeps the ranks in step, its labels count nothing
            batch["labels"] = torch.full_like(batch["labels"], IGNORE_INDEX)
        yield batch


def _check(ok: bool, message: str, who: str = "PackedLoader") -> None:
    if not ok:
        raise DataError(f"{who}: {message}")
