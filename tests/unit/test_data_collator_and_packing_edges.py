"""The MLM collator's random replacements and per-row count, and the packing's separator and last causal block."""

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from comera_dist.data import IGNORE_INDEX, mlm_collator

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCAB = 200


def _tokenizer():
    vocab = {t: i for i, t in enumerate(SPECIALS + [f"w{i}" for i in range(VOCAB - len(SPECIALS))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def test_random_replacements_draw_every_ordinary_token_and_no_special_one():
    ids = torch.randint(5, VOCAB, (256, 256), generator=torch.Generator().manual_seed(0))  # (B, L)
    ids[:, 0], ids[:, -1] = 2, 3
    out = mlm_collator(_tokenizer(), 0.5)(ids, torch.Generator().manual_seed(1))
    sel = out["labels"] != IGNORE_INDEX
    replaced = out["input_ids"][sel & (out["input_ids"] != ids) & (out["input_ids"] != 4)]
    assert len(replaced) > 2000  # ~3,200 random replacements
    assert set(replaced.tolist()) == set(range(5, VOCAB))  # uniform over the 195 ordinary ids, ends included


def test_the_per_row_count_is_rounded_not_truncated():
    ids = torch.randint(5, VOCAB, (4, 12), generator=torch.Generator().manual_seed(0))
    out = mlm_collator(_tokenizer(), 0.15)(ids, torch.Generator().manual_seed(2))
    assert out["mlm_positions"].shape == (4, 2)  # round(0.15 * 12) = round(1.8) = 2
    assert ((out["labels"] != IGNORE_INDEX).sum(1) == 2).all()


def test_the_document_separator_is_the_sep_token_when_there_is_also_an_eos_token():
    from comera_dist.data.packing import separator_id

    vocab = {t: i for i, t in enumerate(SPECIALS + ["[EOS]", "w0"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    both = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]", eos_token="[EOS]")
    assert separator_id(both) == 3  # sep_token, else eos_token (the documented layout)


def test_a_stream_that_fills_its_last_causal_block_exactly_keeps_it():
    import datasets
    import numpy as np

    from comera_dist.data import packing

    vocab = {t: i for i, t in enumerate(SPECIALS + [f"w{i}" for i in range(40)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", sep_token="[SEP]")
    docs = datasets.Dataset.from_dict({"text": ["w1 w2 w3", "w4 w5 w6"]})  # 8 tokens with the separators
    ds = packing.pack(docs, tokenizer, seq_len=4, objective="causal", show_progress=False)
    ids = np.asarray(ds.with_format("numpy")["input_ids"])
    assert ids.tolist() == [[6, 7, 8, 3], [9, 10, 11, 3]]
