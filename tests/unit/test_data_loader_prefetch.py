"""PackedLoader(prefetch=True): the same batches and the same resumable state as without prefetching."""

import datasets
import numpy as np
import pyarrow as pa
import pytest
import torch

from comera_dist.data import PackedLoader

L = 8


def _dataset(n):
    flat = np.repeat(np.arange(n, dtype=np.int32), L)
    return datasets.Dataset(pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(flat), L)}))


def _collate(ids, gen):
    return {"input_ids": ids, "noise": torch.rand(ids.shape[0], generator=gen)}


def _loader(ds, **kw):
    return PackedLoader(ds, batch_size=2, rank=1, world_size=2, seed=3, collator=_collate, **kw)


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("drop_last", [True, False])
def test_prefetch_changes_no_batch_and_no_state(drop_last):
    ds = _dataset(17)  # 4 global batches of 4 per epoch, 1 block left over
    plain, ahead = _loader(ds, drop_last=drop_last), _loader(ds, drop_last=drop_last, prefetch=True)
    for _ in range(13):  # across three epoch boundaries
        assert _same(next(plain), next(ahead))
        assert plain.state_dict() == ahead.state_dict()
    ahead.close()


def test_load_state_dict_discards_the_prefetched_batch():
    ds = _dataset(30)
    straight = _loader(ds)
    expected = [next(straight) for _ in range(12)]
    ahead = _loader(ds, prefetch=True)
    for _ in range(3):
        next(ahead)  # batch 3 is being prefetched now
    ahead.load_state_dict(dict(straight.state_dict(), step=7, position=28, epoch=0))
    other = _loader(ds)
    other.load_state_dict(ahead.state_dict())
    assert all(_same(next(ahead), next(other)) for _ in range(5))
    jumped = _loader(ds, prefetch=True)
    jumped.load_state_dict({**jumped.state_dict(), "position": 12, "step": 3})
    assert _same(next(jumped), expected[3])
    ahead.close()
    jumped.close()
