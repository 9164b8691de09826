"""What ``pack`` puts in the blocks, token for token, on a hand-made corpus with a word-level tokenizer."""

import datasets
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from comera_dist.data import packing

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CLS, SEP = 2, 3
DOCS = ["w10 w3 w7 w1", "w20 w2 w9", "w4 w30 w0 w11 w8"]
DOC_IDS = [[15, 8, 12, 6], [25, 7, 14], [9, 35, 5, 16, 13]]  # "wK" is id 5 + K
STREAM = [i for doc in DOC_IDS for i in (*doc, SEP)]  # (15,): each document, then [SEP]


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {t: i for i, t in enumerate(SPECIALS + [f"w{i}" for i in range(40)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def _docs():
    return datasets.Dataset.from_dict({"text": DOCS})


def _blocks(ds):
    return np.asarray(ds.with_format("numpy")["input_ids"])  # (n, L)


def test_every_document_is_followed_by_the_separator_in_stored_order(tokenizer, monkeypatch):
    monkeypatch.setattr(packing, "CHUNK_DOCS", 2)  # the documents span two tokenizer calls
    stream = packing.token_stream(_docs(), tokenizer, show_progress=False)
    assert stream.dtype == np.int32 and stream.tolist() == STREAM


def test_mlm_block_bodies_are_the_stream_in_order(tokenizer):
    ids = _blocks(packing.pack(_docs(), tokenizer, seq_len=6, objective="mlm", show_progress=False))
    assert ids.shape == (3, 6)  # 15 tokens make three bodies of 4; the last 3 are dropped
    assert (ids[:, 0] == CLS).all() and (ids[:, -1] == SEP).all()
    assert ids[:, 1:-1].reshape(-1).tolist() == STREAM[:12]


def test_causal_blocks_are_the_contiguous_stream(tokenizer):
    ids = _blocks(packing.pack(_docs(), tokenizer, seq_len=4, objective="causal", show_progress=False))
    assert ids.shape == (3, 4)
    assert ids.reshape(-1).tolist() == STREAM[:12]
