"""MLM (80/10/10) and causal collators: statistics, special tokens, determinism per (seed, step, rank)."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from comera_dist.data import IGNORE_INDEX, DataError, batch_seed, causal_collator, collator_for, mlm_collator

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


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_mlm_80_10_10_statistics(tokenizer):
    ids = _blocks(64, 256)
    out = mlm_collator(tokenizer, 0.15)(ids, _gen(1))
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
    out = mlm_collator(tokenizer, 0.15)(ids, _gen(3))
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
    out = mlm_collator(tokenizer, 0.5)(ids, _gen(2))
    special = torch.isin(ids, torch.tensor([2, 3]))
    assert (out["labels"][special] == IGNORE_INDEX).all()
    assert torch.equal(out["input_ids"][special], ids[special])
    inserted = out["input_ids"][(out["input_ids"] != ids) & (out["input_ids"] != 4)]
    assert len(inserted) > 0 and (inserted >= 5).all()


def test_mlm_is_deterministic_in_the_generator(tokenizer):
    ids, collate = _blocks(4, 64), mlm_collator(tokenizer)
    a, b = collate(ids, _gen(batch_seed(0, 5, 1))), collate(ids, _gen(batch_seed(0, 5, 1)))
    assert all(torch.equal(a[k], b[k]) for k in a)
    for other in (batch_seed(0, 6, 1), batch_seed(0, 5, 0), batch_seed(1, 5, 1)):
        assert not torch.equal(collate(ids, _gen(other))["labels"], a["labels"])


def test_mlm_always_has_a_target(tokenizer):
    ids = _blocks(1, 8)
    for s in range(50):  # p=0.01 on 5 eligible tokens: most draws select nothing on their own
        assert (mlm_collator(tokenizer, 0.01)(ids, _gen(s))["labels"] != IGNORE_INDEX).sum() >= 1


def test_batch_seed_is_distinct_and_stable():
    seeds = {batch_seed(s, t, r) for s in range(3) for t in range(50) for r in range(4)}
    assert len(seeds) == 600 and all(0 <= x < 2**63 for x in seeds)
    # pinned: the same on every process, machine and Python (no hash() salt), which resume and every rank rely on
    assert batch_seed(1, 2, 3) == 8384462955522581546 and batch_seed(0, 0, 0) == 8866250585812870066


def test_causal_labels_are_the_inputs(tokenizer):
    ids = _blocks(3, 16)
    out = causal_collator()(ids.int(), _gen(0))
    assert torch.equal(out["input_ids"], ids) and torch.equal(out["labels"], ids)
    assert out["labels"].data_ptr() != out["input_ids"].data_ptr()


def test_collator_for_and_bad_input(tokenizer):
    assert collator_for("causal", tokenizer)(_blocks(1, 8), _gen(0))["labels"].shape == (1, 8)
    with pytest.raises(DataError, match="data.objective must be 'mlm' or 'causal', got 'nsp'"):
        collator_for("nsp", tokenizer)
    with pytest.raises(DataError, match="mlm_probability must be in"):
        mlm_collator(tokenizer, 0.0)


def test_random_replacements_draw_every_ordinary_token_and_no_special_one(tokenizer):
    ids = torch.randint(5, VOCAB, (256, 256), generator=torch.Generator().manual_seed(0))  # (B, L)
    ids[:, 0], ids[:, -1] = 2, 3
    out = mlm_collator(tokenizer, 0.5)(ids, torch.Generator().manual_seed(1))
    sel = out["labels"] != IGNORE_INDEX
    replaced = out["input_ids"][sel & (out["input_ids"] != ids) & (out["input_ids"] != 4)]
    assert len(replaced) > 2000  # ~3,200 random replacements
    assert set(replaced.tolist()) == set(range(5, VOCAB))  # uniform over the 195 ordinary ids, ends included


def test_the_per_row_count_is_rounded_not_truncated(tokenizer):
    ids = torch.randint(5, VOCAB, (4, 12), generator=torch.Generator().manual_seed(0))
    out = mlm_collator(tokenizer, 0.15)(ids, torch.Generator().manual_seed(2))
    assert out["mlm_positions"].shape == (4, 2)  # round(0.15 * 12) = round(1.8) = 2
    assert ((out["labels"] != IGNORE_INDEX).sum(1) == 2).all()
