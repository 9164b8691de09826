"""Tokenizing documents and packing the token stream into fixed-length blocks.

Layout (documented contract for the models):
- every document is tokenized without special tokens and followed by ``[SEP]`` (the tokenizer's
  ``sep_token``, else its ``eos_token``), and the documents are concatenated in stored order. Text that
  spells a special token ("[SEP]", "[MASK]" in code or prose) is tokenized as the text it is, so only the
  layout's own separators, ``[CLS]`` and the collator's masks carry special ids;
- ``mlm``: the stream is cut into chunks of ``seq_len - 2`` tokens, each block is
  ``[CLS] chunk [SEP]``;
- ``causal``: the stream is cut into blocks of ``seq_len`` tokens (labels are the inputs; the
  model shifts them);
- the tail shorter than one block is dropped, so every block is full and needs no padding.
"""

from __future__ import annotations

import datasets
import numpy as np
import pyarrow as pa
from tqdm.auto import tqdm
from transformers import PreTrainedTokenizerBase

from comera_dist.data.errors import DataError

CHUNK_DOCS = 256
"""Documents tokenized per call (and per progress-bar update)."""
LAYOUT_VERSION = 2
"""Part of the packed blocks' cache key: bump when the same text and tokenizer pack differently (2: text
spelling a special token stays text)."""


def separator_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id appended after each document: ``sep_token``, else ``eos_token``."""
    sep = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    if sep is None:
        raise DataError(f"tokenizer {type(tokenizer).__name__} has neither a sep_token nor an eos_token "
                        "to separate documents")
    return sep


def pack(docs: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, *, seq_len: int, objective: str,
         desc: str = "packing", show_progress: bool = True,
         too_short: str = "add text or lower data.seq_len") -> datasets.Dataset:
    """Blocks ``input_ids (num_blocks, seq_len)`` int32 from the ``text`` column of ``docs``.

    ``too_short``: the remedy named when the text makes no block (a caller whose ``seq_len`` is not the
    user's to lower, as an evaluation's, names its own)."""
    stream = token_stream(docs, tokenizer, desc=desc, show_progress=show_progress)  # (num_tokens,)
    if objective == "mlm":
        if tokenizer.cls_token_id is None or tokenizer.mask_token_id is None:
            raise DataError(f"objective 'mlm' needs a tokenizer with cls_token and mask_token; "
                            f"{type(tokenizer).__name__} has cls={tokenizer.cls_token!r} "
                            f"mask={tokenizer.mask_token!r}")
        body = seq_len - 2
        n = len(stream) // body
        blocks = np.empty((n, seq_len), dtype=np.int32)  # (n, L)
        blocks[:, 0] = tokenizer.cls_token_id
        blocks[:, 1:-1] = stream[:n * body].reshape(n, body)
        blocks[:, -1] = separator_id(tokenizer)
    else:
        n = len(stream) // seq_len
        blocks = stream[:n * seq_len].reshape(n, seq_len)  # (n, L)
    if n == 0:
        raise DataError(f"{desc}: {len(stream)} tokens from {len(docs)} documents make no block of "
                        f"data.seq_len={seq_len}; {too_short}")
    table = pa.table({"input_ids": pa.FixedSizeListArray.from_arrays(pa.array(blocks.reshape(-1)), seq_len)})
    return datasets.Dataset(table)


def token_stream(docs: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, *, desc: str = "tokenizing",
                 show_progress: bool = True) -> np.ndarray:
    """All documents' token ids, each followed by the separator: ``(num_tokens,)`` int32."""
    sep = separator_id(tokenizer)
    pieces: list[np.ndarray] = []
    with tqdm(total=len(docs), desc=desc, unit="doc", disable=not show_progress) as bar:
        for start in range(0, len(docs), CHUNK_DOCS):
            texts = docs[start:start + CHUNK_DOCS]["text"]
            encoded = tokenizer(texts, add_special_tokens=False, split_special_tokens=True, verbose=False)
            for ids in encoded["input_ids"]:
                pieces.append(np.asarray(ids, dtype=np.int32))
                pieces.append(np.asarray([sep], dtype=np.int32))
            bar.update(len(texts))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
