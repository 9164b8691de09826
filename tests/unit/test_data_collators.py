"""MLM (80/10/10) and causal collators: statistics, special tokens, masks that depend on each block's key alone."""

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from comera_dist.data import IGNORE_INDEX, DataError, batch_seed, causal_collator, collator_for, mlm_collator
from comera_dist.data.noise import block_keys, uniform

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = 200


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {t: i for i, t in enumerate(SPECIALS + [f"w{i}" for i in range(VOCAB - len(SPECIALS))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def _blocks(b, L, seed=0):
    ids = torch.randint(5, VOCAB, (b, L), generator=torch.Generator().manual_seed(seed))  # (B, L)
    ids[:, 0], ids[:, -1] = 2, 3  # [CLS] ... [SEP]
    ids[:, L // 2] = 3  # a document separator inside the block
    return ids


def _keys(ids, seed, epoch=0, first=0):
    """Keys of ``ids``' rows as a loader gives them: blocks ``first, first + 1, ...`` of ``epoch``."""
    return block_keys(seed, epoch, range(first, first + ids.shape[0]))


def test_mlm_80_10_10_statistics(tokenizer):
    ids = _blocks(64, 256)
    out = mlm_collator(tokenizer, 0.15)(ids, _keys(ids, 1))
    sel = out["labels"] != IGNORE_INDEX
    eligible = ~torch.isin(ids, torch.tensor([0, 1, 2, 3, 4]))
    frac = sel.sum() / eligible.sum()
    assert abs(frac - 0.15) < 0.01, frac
    n = sel.sum()
    masked = (out["input_ids"] == 4) & sel
    changed = (out["input_ids"] != ids) & sel & ~masked
    kept = (out["input_ids"] == ids) & sel
    assert abs(masked.sum() / n - 0.8) < 0.02
    # a random replacement equals the original with probability 1/195: fold that in
    assert abs((changed.sum() + kept.sum()) / n - 0.2) < 0.02 and abs(changed.sum() / n - 0.1) < 0.02
    assert torch.equal(out["labels"][sel], ids[sel])  # labels carry the originals
    assert torch.equal(out["input_ids"][~sel], ids[~sel])  # nothing else changes
    assert "attention_mask" not in out  # packed blocks have no padding: no mask, so SDPA may use flash kernels
    assert all(out[k].dtype == torch.int64 and out[k].shape == ids.shape for k in ("input_ids", "labels"))


def test_mlm_positions_hold_every_label_in_a_fixed_count_per_row(tokenizer):
    ids = _blocks(16, 40)
    ids[5, 1:38] = 3  # P = round(0.15 * 40) = 6; this row keeps 1 eligible token: 1 label, 5 unselected
    out = mlm_collator(tokenizer, 0.15)(ids, _keys(ids, 3))
    pos, labels = out["mlm_positions"], out["labels"]
    assert pos.shape == (16, 6) and pos.dtype == torch.int64
    assert (pos.diff(dim=1) > 0).all()  # ascending, no repeats
    picked = labels.gather(1, pos)  # (B, P)
    # every label sits at a listed position: nothing the model's gathered head would miss
    assert torch.equal((picked != IGNORE_INDEX).sum(1), (labels != IGNORE_INDEX).sum(1))
    per_row = (labels != IGNORE_INDEX).sum(1)
    assert per_row[5] == 1 and (per_row[[i for i in range(16) if i != 5]] == 6).all()


def test_mlm_never_selects_or_inserts_special_tokens(tokenizer):
    ids = _blocks(32, 64)
    out = mlm_collator(tokenizer, 0.5)(ids, _keys(ids, 2))
    special = torch.isin(ids, torch.tensor([2, 3]))
    assert (out["labels"][special] == IGNORE_INDEX).all()
    assert torch.equal(out["input_ids"][special], ids[special])
    inserted = out["input_ids"][(out["input_ids"] != ids) & (out["input_ids"] != 4)]
    assert len(inserted) > 0 and (inserted >= 5).all()


def test_a_rows_masks_depend_on_its_key_alone(tokenizer):
    ids, collate = _blocks(6, 64), mlm_collator(tokenizer)
    whole = collate(ids, _keys(ids, 0, epoch=2, first=10))
    again = collate(ids, _keys(ids, 0, epoch=2, first=10))
    assert all(torch.equal(whole[k], again[k]) for k in whole)
    # the same blocks collated one by one, or in other groupings (other ranks, micro-batches): the same rows
    keys = _keys(ids, 0, epoch=2, first=10)
    rows = [collate(ids[i:i + 1], keys[i:i + 1]) for i in range(6)]
    pair = [collate(ids[i:i + 2], keys[i:i + 2]) for i in (0, 2, 4)]
    for k in whole:
        assert torch.equal(torch.cat([r[k] for r in rows]), whole[k]) and torch.equal(torch.cat([p[k] for p in pair]),
                                                                                       whole[k])
    # another seed, epoch or slot: other masks
    for other in (_keys(ids, 1, epoch=2, first=10), _keys(ids, 0, epoch=3, first=10), _keys(ids, 0, epoch=2, first=11)):
        assert not torch.equal(collate(ids, other)["labels"], whole["labels"])


def test_block_keys_and_uniforms_are_distinct_stable_and_uniform():
    keys = np.concatenate([block_keys(s, e, range(100)) for s in range(3) for e in (-1, 0, 1)])
    assert keys.dtype == np.uint64 and len(set(keys.tolist())) == 900
    # pinned: the same on every process, machine and Python (no hash() salt), which resume and every rank rely on
    assert block_keys(1, 2, [3]).tolist() == [int(block_keys(1, 2, range(4))[3])]
    assert block_keys(0, 0, [0]).tolist() == [4567320430866802437]
    u = torch.stack([uniform(block_keys(0, 0, range(512)), 256, s) for s in range(3)])  # (3, 512, 256)
    assert u.dtype == torch.float64 and (u >= 0).all() and (u < 1).all()
    assert abs(u.mean() - 0.5) < 0.005 and abs(u.var() - 1 / 12) < 0.002
    hist = torch.histc(u.flatten().float(), bins=10, min=0, max=1) / u.numel()  # each decile ~0.1
    assert (hist - 0.1).abs().max() < 0.002
    # the streams and positions of one block are unrelated (no draw reused for another decision)
    corr = torch.corrcoef(u.reshape(3, -1))
    assert (corr - torch.eye(3, dtype=corr.dtype)).abs().max() < 0.01
    assert abs(torch.corrcoef(torch.stack([u[0, :, :-1].flatten(), u[0, :, 1:].flatten()]))[0, 1]) < 0.01
    with pytest.raises(ValueError, match="stream must be in"):
        uniform(keys, 4, 7)
    with pytest.raises(ValueError, match="slots must be a 1-D array of indices >= 0"):
        block_keys(0, 0, [-1])


def test_a_collator_names_blocks_and_keys_that_do_not_match(tokenizer):
    ids = _blocks(3, 16)
    for collate in (mlm_collator(tokenizer), causal_collator()):
        with pytest.raises(DataError, match=r"one key per block \(B,\); got blocks \(3, 16\) and keys \(2,\)"):
            collate(ids, block_keys(0, 0, range(2)))


def test_mlm_always_has_a_target(tokenizer):
    ids = _blocks(1, 8)
    for s in range(50):  # p=0.01 on 5 eligible tokens: most draws select nothing on their own
        assert (mlm_collator(tokenizer, 0.01)(ids, _keys(ids, s))["labels"] != IGNORE_INDEX).sum() >= 1


def test_batch_seed_is_distinct_and_stable():
    seeds = {batch_seed(s, t, r) for s in range(3) for t in range(50) for r in range(4)}
    assert len(seeds) == 600 and all(0 <= x < 2**63 for x in seeds)
    # pinned: the same on every process, machine and Python (no hash() salt), which resume and every rank rely on
    assert batch_seed(1, 2, 3) == 8384462955522581546 and batch_seed(0, 0, 0) == 8866250585812870066


def test_causal_labels_are_the_inputs(tokenizer):
    ids = _blocks(3, 16)
    out = causal_collator()(ids.int(), _keys(ids, 0))
    assert torch.equal(out["input_ids"], ids) and torch.equal(out["labels"], ids)
    assert out["labels"].data_ptr() != out["input_ids"].data_ptr()


def test_collator_for_and_bad_input(tokenizer):
    assert collator_for("causal", tokenizer)(_blocks(1, 8), _keys(_blocks(1, 8), 0))["labels"].shape == (1, 8)
    with pytest.raises(DataError, match="data.objective must be 'mlm' or 'causal', got 'nsp'"):
        collator_for("nsp", tokenizer)
    with pytest.raises(DataError, match="mlm_probability must be in"):
        mlm_collator(tokenizer, 0.0)


def test_random_replacements_draw_every_ordinary_token_and_no_special_one(tokenizer):
    ids = torch.randint(5, VOCAB, (256, 256), generator=torch.Generator().manual_seed(0))  # (B, L)
    ids[:, 0], ids[:, -1] = 2, 3
    out = mlm_collator(tokenizer, 0.5)(ids, _keys(ids, 1))
    sel = out["labels"] != IGNORE_INDEX
    replaced = out["input_ids"][sel & (out["input_ids"] != ids) & (out["input_ids"] != 4)]
    assert len(replaced) > 2000  # ~3,200 random replacements
    assert set(replaced.tolist()) == set(range(5, VOCAB))  # uniform over the 195 ordinary ids, ends included


def test_the_per_row_count_is_rounded_not_truncated(tokenizer):
    ids = torch.randint(5, VOCAB, (4, 12), generator=torch.Generator().manual_seed(0))
    out = mlm_collator(tokenizer, 0.15)(ids, _keys(ids, 2))
    assert out["mlm_positions"].shape == (4, 2)  # round(0.15 * 12) = round(1.8) = 2
    assert ((out["labels"] != IGNORE_INDEX).sum(1) == 2).all()
