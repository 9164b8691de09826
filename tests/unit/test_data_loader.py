"""PackedLoader: exact resume, disjoint per-rank shards, epoch reshuffles, eval shards, masks keyed by block."""

import datasets
import numpy as np
import pyarrow as pa
import pytest
import torch

from comera_dist.data import IGNORE_INDEX, DataError, PackedLoader, causal_collator, eval_batches
from comera_dist.data.noise import uniform

L = 8


def _dataset(n):
    """Block ``i`` is ``[i, i, ...]`` so a batch tells which blocks it holds."""
    flat = np.repeat(np.arange(n, dtype=np.int32), L)
    return datasets.Dataset(pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(flat), L)}))


def _noisy_collator(ids, keys):
    """Identity plus each block's first uniform draw (what its masks derive from), so the keying is checked too."""
    return {"input_ids": ids, "labels": ids.clone(), "noise": uniform(keys, 1, 0)[:, 0]}


def _block_ids(batch):
    return batch["input_ids"][:, 0].tolist()


def _loader(ds, rank=0, world=1, bs=4, seed=3, **kw):
    return PackedLoader(ds, batch_size=bs, rank=rank, world_size=world, seed=seed, collator=_noisy_collator, **kw)


@pytest.mark.parametrize("n_first", [3, 7, 12])  # mid-epoch, on the epoch boundary (7 per epoch), next epoch
def test_resume_continues_with_the_exact_next_batch(n_first):
    ds, m = _dataset(30), 9
    straight = _loader(ds, rank=1, world=2, bs=2)
    expected = [next(straight) for _ in range(n_first + m)][n_first:]
    first = _loader(ds, rank=1, world=2, bs=2)
    for _ in range(n_first):
        next(first)
    state = first.state_dict()
    assert all(isinstance(v, int) for v in state.values())
    resumed = _loader(ds, rank=1, world=2, bs=2)
    resumed.load_state_dict(state)
    got = [next(resumed) for _ in range(m)]
    for e, g in zip(expected, got):
        assert torch.equal(e["input_ids"], g["input_ids"]) and torch.equal(e["noise"], g["noise"])


def test_ranks_get_disjoint_equal_shards_covering_the_epoch():
    ds, world, bs = _dataset(50), 3, 4
    loaders = [_loader(ds, rank=r, world=world, bs=bs) for r in range(world)]
    per_epoch = loaders[0].batches_per_epoch
    assert per_epoch == 50 // (world * bs) == 4
    seen = [[i for _ in range(per_epoch) for i in _block_ids(next(ld))] for ld in loaders]
    flat = [i for s in seen for i in s]
    assert len(flat) == len(set(flat)) == per_epoch * world * bs  # disjoint across ranks
    assert all(len(s) == per_epoch * bs for s in seen)
    # the next batch starts epoch 1: a new order over all blocks
    assert {ld.epoch for ld in loaders} == {0} and next(loaders[0]) and loaders[0].epoch == 1


def test_epochs_reshuffle_and_seed_matters():
    ds = _dataset(16)
    ld = _loader(ds, bs=16)
    e0, e1 = _block_ids(next(ld)), _block_ids(next(ld))
    assert sorted(e0) == sorted(e1) == list(range(16)) and e0 != e1
    assert _block_ids(next(_loader(ds, bs=16))) == e0
    assert _block_ids(next(_loader(ds, bs=16, seed=4))) != e0


def test_masks_are_drawn_afresh_for_every_block_and_epoch():
    """Keys are (seed, epoch, slot): no two blocks of an epoch, and no block in two epochs, share a mask stream."""
    ds = _dataset(8)
    loaders = [_loader(ds, rank=r, world=2, bs=2) for r in range(2)]
    drawn = [next(ld) for _ in range(4) for ld in loaders]  # two epochs: each block twice
    noise = torch.cat([b["noise"] for b in drawn])  # (16,)
    assert len(set(noise.tolist())) == 16
    again = [next(_loader(ds, rank=r, world=2, bs=2)) for r in range(2)]
    assert all(torch.equal(a["noise"], b["noise"]) for a, b in zip(again, drawn))


def test_an_epoch_that_divides_evenly_is_used_to_its_last_block():
    """16 blocks in global batches of 4: four batches, the last ending on the epoch's last block, then epoch 1."""
    ld = _loader(_dataset(16), bs=4)
    assert ld.batches_per_epoch == 4
    seen = [i for _ in range(4) for i in _block_ids(next(ld))]
    assert sorted(seen) == list(range(16)) and ld.epoch == 0
    next(ld)
    assert (ld.epoch, ld.position, ld.step) == (1, 4, 5)


def test_resume_on_another_world_size_continues_with_the_unseen_blocks():
    ds = _dataset(40)
    two = [_loader(ds, rank=r, world=2, bs=2) for r in range(2)]
    for _ in range(3):
        for ld in two:
            next(ld)
    next_two = [next(ld) for ld in two]
    one = _loader(ds, world=1, bs=4)
    state = two[0].state_dict()
    state["position"] -= 4  # the state as saved before that last global batch
    state["step"] -= 1
    one.load_state_dict(state)
    got = next(one)  # the same blocks with the same masks, in rank order
    assert torch.equal(got["input_ids"], torch.cat([b["input_ids"] for b in next_two]))
    assert torch.equal(got["noise"], torch.cat([b["noise"] for b in next_two]))


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_see_what_one_rank_accumulating_micro_batches_sees(world):
    """W ranks with one micro-batch of B each, and one rank with W micro-batches of B: the same blocks and masks
    at every step (what lets an elastic resume keep the global batch, and the run, as it was)."""
    ds, bs = _dataset(4 * world * 5), 4  # whole epochs at both world sizes
    ranks = [_loader(ds, rank=r, world=world, bs=bs) for r in range(world)]
    one = _loader(ds, world=1, bs=bs)
    for _ in range(7):  # across an epoch boundary (5 steps per epoch)
        for ld in ranks:
            mine, alone = next(ld), next(one)
            assert torch.equal(mine["input_ids"], alone["input_ids"]) and torch.equal(mine["noise"], alone["noise"])


def test_drop_last_false_wraps_so_ranks_stay_in_step():
    ds = _dataset(10)
    loaders = [_loader(ds, rank=r, world=2, bs=2, drop_last=False) for r in range(2)]
    assert loaders[0].batches_per_epoch == 3
    seen = [i for _ in range(3) for ld in loaders for i in _block_ids(next(ld))]
    assert set(seen) == set(range(10)) and len(seen) == 12  # two blocks of the epoch's start repeat
    assert loaders[0].epoch == 0 and next(loaders[0]) and loaders[0].epoch == 1


def test_bad_arguments_and_mismatched_state():
    ds = _dataset(10)
    with pytest.raises(DataError, match=r"rank=2 not in \[0, world_size=2\)"):
        _loader(ds, rank=2, world=2)
    with pytest.raises(DataError, match="batch_size must be >= 1, got 0"):
        _loader(ds, bs=0)
    with pytest.raises(DataError, match="10 blocks, fewer than one global batch"):
        _loader(ds, world=3, bs=4)
    state = _loader(_dataset(12)).state_dict()
    with pytest.raises(DataError, match="saved over 12 blocks, this dataset has 10"):
        _loader(ds).load_state_dict(state)
    with pytest.raises(DataError, match="loader state has seed 3, this loader 9"):
        _loader(_dataset(12), seed=9).load_state_dict(state)
    with pytest.raises(DataError, match=r"loader state lacks \['num_blocks', 'position', 'seed', 'step'\]"):
        _loader(ds).load_state_dict({"epoch": 0})


def _eval_pass(ds, world, bs, **kw):
    return [list(eval_batches(ds, batch_size=bs, rank=r, world_size=world, seed=5, collator=_noisy_collator, **kw))
            for r in range(world)]


def test_eval_batches_shard_near_equally_and_repeat_masks():
    shards = _eval_pass(_dataset(23), 2, 3)
    assert len(shards[0]) == len(shards[1]) == 4  # 12 + 11 blocks: 3+3+3+3 and 3+3+3+2
    ids = [[i for b in s for i in _block_ids(b)] for s in shards]
    assert ids == [list(range(12)), list(range(12, 23))]  # every block, none left out
    again = _eval_pass(_dataset(23), 2, 3)[0]
    assert all(torch.equal(a["noise"], b["noise"]) for a, b in zip(shards[0], again))
    capped = eval_batches(_dataset(23), batch_size=3, rank=0, world_size=1, seed=5, collator=causal_collator(),
                          max_blocks=6)
    assert [b["labels"].shape for b in capped] == [(3, L), (3, L)]
    with pytest.raises(DataError, match="eval_batches: the evaluation set has 2 blocks, fewer than world_size=4"):
        next(eval_batches(_dataset(2), batch_size=1, rank=0, world_size=4, seed=0, collator=_noisy_collator))
    with pytest.raises(DataError, match="eval_batches: max_blocks must be >= 1, got 0"):
        next(eval_batches(_dataset(2), batch_size=1, rank=0, world_size=1, seed=0, collator=_noisy_collator,
                          max_blocks=0))


@pytest.mark.parametrize(("n", "bs", "cap"), [(23, 3, None), (17, 1, None), (40, 4, 13), (9, 2, None)])
def test_an_eval_pass_is_the_same_blocks_and_masks_at_every_world_size(n, bs, cap):
    """The ranks' batches together are one rank's pass: a validation loss does not depend on the world size."""
    ds = _dataset(n)

    def counted(shards):  # (block, noise) of every label-bearing row, in rank order
        rows = [(i, float(x)) for s in shards for b in s for i, x, lab in
                zip(_block_ids(b), b["noise"], b["labels"][:, 0]) if lab != IGNORE_INDEX]
        return rows

    alone = counted(_eval_pass(ds, 1, bs, max_blocks=cap))
    assert [i for i, _ in alone] == list(range(n if cap is None else cap))
    for world in (2, 3, 4):
        shards = _eval_pass(ds, world, bs, max_blocks=cap)
        assert len({len(s) for s in shards}) == 1  # the ranks stay in step (ZeRO-3 forwards are collective)
        assert all(len(b["input_ids"]) <= bs for s in shards for b in s)
        assert counted(shards) == alone


def test_a_short_shard_at_batch_size_one_ends_with_a_filler_that_counts_no_label():
    shards = _eval_pass(_dataset(5), 2, 1)  # 3 + 2 blocks: rank 1 needs a third forward
    assert [len(s) for s in shards] == [3, 3]
    filler = shards[1][-1]
    assert _block_ids(filler) == [4] and (filler["labels"] == IGNORE_INDEX).all()
    assert all((b["labels"] != IGNORE_INDEX).all() for s in shards for b in s if b is not filler)


def test_drop_last_false_on_an_even_epoch_starts_the_next_epoch_without_a_wrapped_batch():
    ld = _loader(_dataset(16), bs=4, drop_last=False)
    assert ld.batches_per_epoch == 4
    seen = [i for _ in range(4) for i in _block_ids(next(ld))]
    assert sorted(seen) == list(range(16))
    next(ld)
    assert (ld.epoch, ld.position, ld.step) == (1, 4, 5)


def test_drop_last_false_completes_the_last_batch_with_the_epochs_first_blocks():
    ld = _loader(_dataset(10), bs=4, drop_last=False)
    first, _, last = (_block_ids(next(ld)) for _ in range(3))
    assert last[2:] == first[:2]  # the tail (2 blocks) plus the start of the same epoch's order


def test_rank_r_takes_the_r_th_contiguous_slice_of_the_global_batch():
    ds = _dataset(24)
    whole = [_block_ids(next(_loader(ds, bs=6)))]
    parts = [_block_ids(next(_loader(ds, rank=r, world=3, bs=2))) for r in range(3)]
    assert parts == [whole[0][0:2], whole[0][2:4], whole[0][4:6]]
