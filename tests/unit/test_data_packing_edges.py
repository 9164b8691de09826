"""Packing edges: the separator of a tokenizer with both sep and eos, and a causal stream filling its last block."""

import datasets
import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from comera_dist.data import packing

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _word_level(words: list[str], **specials: str) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer: SPECIALS (ids 0-4), then ``words``."""
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", **specials)


def test_the_document_separator_is_the_sep_token_when_there_is_also_an_eos_token():
    both = _word_level(["[EOS]", "w0"], sep_token="[SEP]", eos_token="[EOS]")
    assert packing.separator_id(both) == 3  # sep_token, else eos_token (the documented layout)


def test_a_stream_that_fills_its_last_causal_block_exactly_keeps_it():
    tokenizer = _word_level([f"w{i}" for i in range(40)], sep_token="[SEP]")
    docs = datasets.Dataset.from_dict({"text": ["w1 w2 w3", "w4 w5 w6"]})  # 8 tokens with the separators
    ds = packing.pack(docs, tokenizer, seq_len=4, objective="causal", show_progress=False)
    ids = np.asarray(ds.with_format("numpy")["input_ids"])
    assert ids.tolist() == [[6, 7, 8, 3], [9, 10, 11, 3]]


def test_text_that_spells_a_special_token_is_packed_as_text():
    # Code and prose mention "[SEP]" or "[MASK]"; as ids 3 and 4 they would read as a document boundary or a
    # position the collator already masked. Only the layout's own [CLS]/[SEP] may carry special ids.
    tokenizer = _word_level(["[", "]", "SEP", "MASK", "CLS", "a"], sep_token="[SEP]", cls_token="[CLS]",
                            mask_token="[MASK]")
    docs = datasets.Dataset.from_dict({"text": ["a [SEP] a [MASK] [CLS] a"]})
    ds = packing.pack(docs, tokenizer, seq_len=15, objective="mlm", show_progress=False)
    ids = np.asarray(ds.with_format("numpy")["input_ids"])
    # [CLS], then a [ SEP ] a [ MASK ] [ CLS ] a as text, the document's separator, the block's [SEP]
    assert ids.tolist() == [[2, 10, 5, 7, 6, 10, 5, 8, 6, 5, 9, 6, 10, 3, 3]]
