"""``PackedLoader`` edges: ``drop_last=False`` epoch ends and wrap-around order, and each rank's contiguous slice."""

import datasets
import numpy as np
import pyarrow as pa
import torch

from comera_dist.data import PackedLoader

L = 8


def _dataset(n):
    flat = np.repeat(np.arange(n, dtype=np.int32), L)
    return datasets.Dataset(pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(flat), L)}))


def _collate(ids, gen):
    return {"input_ids": ids, "noise": torch.rand(ids.shape[0], generator=gen)}


def _loader(ds, rank=0, world=1, bs=4, seed=3, **kw):
    return PackedLoader(ds, batch_size=bs, rank=rank, world_size=world, seed=seed, collator=_collate, **kw)


def _ids(batch):
    return batch["input_ids"][:, 0].tolist()


def test_drop_last_false_on_an_even_epoch_starts_the_next_epoch_without_a_wrapped_batch():
    ld = _loader(_dataset(16), bs=4, drop_last=False)
    assert ld.batches_per_epoch == 4
    seen = [i for _ in range(4) for i in _ids(next(ld))]
    assert sorted(seen) == list(range(16))
    next(ld)
    assert (ld.epoch, ld.position, ld.step) == (1, 4, 5)


def test_drop_last_false_completes_the_last_batch_with_the_epochs_first_blocks():
    ld = _loader(_dataset(10), bs=4, drop_last=False)
    first, _, last = (_ids(next(ld)) for _ in range(3))
    assert last[2:] == first[:2]  # the tail (2 blocks) plus the start of the same epoch's order


def test_rank_r_takes_the_r_th_contiguous_slice_of_the_global_batch():
    ds = _dataset(24)
    whole = [_ids(next(_loader(ds, bs=6)))]
    parts = [_ids(next(_loader(ds, rank=r, world=3, bs=2))) for r in range(3)]
    assert parts == [whole[0][0:2], whole[0][2:4], whole[0][4:6]]
