"""PackedLoader(prefetch=True): the same batches and the same resumable state as without prefetching."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pytest
import torch

from comera_dist.data import PackedLoader
from comera_dist.data.noise import uniform

L = 8


def _dataset(n):
    flat = np.repeat(np.arange(n, dtype=np.int32), L)
    return datasets.Dataset(pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(flat), L)}))


def _collate(ids, keys):
    return {"input_ids": ids, "noise": uniform(keys, 1, 0)[:, 0]}


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


PROBE = """
import torch
from test_data_loader_prefetch import PackedLoader, _collate, _dataset
seen = []
def collate(ids, keys):
    seen.append(torch.get_num_threads())
    return _collate(ids, keys)
loader = PackedLoader(_dataset(9), batch_size=2, rank=0, world_size=1, seed=0, collator=collate, prefetch=True)
for _ in range(3):
    next(loader)
loader.close()
print(torch.get_num_threads(), seen)
"""


def test_prefetch_thread_runs_torch_on_one_intra_op_thread():
    """An OpenMP team of the prefetch thread's own would spin on every core after each batch and starve
    the training thread (the trainer ran 25x slower on 2 cores). Run with 2 OpenMP threads (the test
    suite's default is 1, where the problem cannot show): batches after the first, made on the prefetch
    thread, see one intra-op thread; the main thread keeps its two."""
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONPATH=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
                         check=True).stdout.split(maxsplit=1)
    main, seen = int(out[0]), ast.literal_eval(out[1])
    assert main == 2 and seen[0] == 2 and seen[1:] == [1] * (len(seen) - 1), (main, seen)
