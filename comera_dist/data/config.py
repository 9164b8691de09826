"""The data section of the run config: corpus source, split, tokenizer, packing, cache."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Source = Literal["stdlib", "files", "hf"]
Builder = Literal["text", "json", "parquet"]
SplitBy = Literal["auto", "file", "document"]


SPLIT_BY_OF_SOURCE: dict[str, tuple[str, str]] = {
    "stdlib": ("file", "a hash of each path under the stdlib root"),
    "hf": ("document", "a hash of each text, or the dataset's own train/validation splits"),
}
"""The one split each fixed-split source honours, and how it draws it (``data.corpus``)."""


BPE_MIN_VOCAB = 256 + 5
"""The fewest tokens a trained byte-level BPE has: the 256-byte alphabet and ``tokenizer.SPECIAL_TOKENS``."""


@dataclass(kw_only=True, slots=True)
class TokenizerConfig:
    """How the tokenizer is trained (with ``tokenizers``, on the train split) or where it is loaded from."""

    kind: Literal["bpe", "wordpiece"] = "bpe"
    """``bpe``: byte-level BPE (lossless on code); ``wordpiece``: BERT-style WordPiece."""
    vocab_size: int = 8000
    """Target vocabulary size, special tokens included (a small corpus may yield fewer)."""
    min_frequency: int = 2
    """A merge/word-piece must occur at least this often in the training text."""
    max_train_bytes: int = 8_000_000
    """Cap on the training text fed to the tokenizer trainer (the train split in its stored order)."""
    pretrained: str | None = None
    """A local directory holding a saved ``PreTrainedTokenizerFast`` to use instead of training one."""

    def __post_init__(self) -> None:
        if self.vocab_size < 16:
            raise ValueError(f"tokenizer.vocab_size must be >= 16, got {self.vocab_size}")
        if self.kind == "bpe" and self.vocab_size < BPE_MIN_VOCAB and self.pretrained is None:
            # byte-level BPE keeps all 256 bytes whatever the target: the run learned so only after its data build
            raise ValueError(f"tokenizer.vocab_size must be >= {BPE_MIN_VOCAB} for kind bpe (its 256 byte tokens and "
                             f"5 special tokens), got {self.vocab_size}")
        if self.min_frequency < 1:
            raise ValueError(f"tokenizer.min_frequency must be >= 1, got {self.min_frequency}")
        if self.max_train_bytes < 1:
            raise ValueError(f"tokenizer.max_train_bytes must be >= 1, got {self.max_train_bytes}")
        if self.pretrained is not None and not self.pretrained.strip():
            raise ValueError("tokenizer.pretrained must be a directory path or null, got ''")


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where the text comes from, how it is split, tokenized and packed, and where it is cached."""

    source: Source = "stdlib"
    """``stdlib``: the running interpreter's standard library ``.py`` files (site-packages excluded);
    ``files``: local text/JSON/Parquet files (``files``); ``hf``: ``datasets.load_dataset(**hf_kwargs)``."""
    files: list[str] = field(default_factory=list)
    """For ``source: files``: files, directories (searched recursively) or glob patterns."""
    builder: Builder | None = None
    """For ``source: files``: the ``datasets`` builder; ``null`` infers it from the file extensions."""
    text_column: str = "text"
    """The column holding the text (JSON/Parquet files and ``hf`` datasets)."""
    sample_by: Literal["document", "paragraph", "line"] = "document"
    """For the ``text`` builder: one example per file, paragraph or line."""
    hf_kwargs: dict[str, Any] = field(default_factory=dict)
    """For ``source: hf``: keyword arguments of ``datasets.load_dataset`` (cached by these values and the size and
    modification time of every local file they name)."""
    validation_fraction: float = 0.05
    """Fraction of files (or documents) hashed into the validation split."""
    split_salt: str = "comera-dist"
    """Salt of the split hash: change it to draw a different, still deterministic, split."""
    split_by: SplitBy = "auto"
    """``file``: hash the path relative to the corpus root; ``document``: hash the text;
    ``auto``: by file when that gives both splits at least one file, else by document. Only the ``files``
    source chooses: ``stdlib`` always splits by file and ``hf`` by document (``SPLIT_BY_OF_SOURCE``)."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """The tokenizer section."""
    seq_len: int = 128
    """Tokens per packed block (special tokens included)."""
    objective: Literal["mlm", "causal"] = "mlm"
    """``mlm``: blocks are ``[CLS] ... [SEP]`` and masked 80/10/10; ``causal``: plain packed tokens."""
    mlm_probability: float = 0.15
    """Masked-language-model selection: ``max(1, round(mlm_probability * seq_len))`` non-special tokens per
    block, a slightly larger share of the non-special ones (``[CLS]``, ``[SEP]`` and document separators
    are never selected)."""
    cache_dir: str | None = None
    """Cache root; ``null`` means ``$COMERA_CACHE`` or ``~/.cache/comera-dist``."""
    max_files: int | None = None
    """Cap on the number of files read (``stdlib`` and ``files`` sources), for tiny CPU runs."""
    num_proc: int = 1
    """Worker processes for ``datasets.load_dataset`` (``files`` and ``hf`` sources)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.validation_fraction < 1.0:
            raise ValueError(f"data.validation_fraction must be in (0, 1), got {self.validation_fraction}")
        if self.seq_len < 8:
            raise ValueError(f"data.seq_len must be >= 8, got {self.seq_len}")
        if not 0.0 < self.mlm_probability < 1.0:
            raise ValueError(f"data.mlm_probability must be in (0, 1), got {self.mlm_probability}")
        if self.max_files is not None and self.max_files < 2:
            raise ValueError(f"data.max_files must be >= 2 (one per split) or null, got {self.max_files}")
        if self.num_proc < 1:
            raise ValueError(f"data.num_proc must be >= 1, got {self.num_proc}")
        if not self.text_column:
            raise ValueError("data.text_column must be a non-empty column name, got ''")
        if self.source == "files" and not self.files:
            raise ValueError("data.files must list at least one path when data.source is 'files', got []")
        if self.source != "files" and self.files:
            raise ValueError(f"data.files is only read when data.source is 'files' (source is "
                             f"{self.source!r}), got {self.files}")
        if self.source == "hf" and not self.hf_kwargs:
            raise ValueError("data.hf_kwargs must hold load_dataset arguments (at least 'path') "
                             "when data.source is 'hf', got {}")
        if self.source != "hf" and self.hf_kwargs:
            raise ValueError(f"data.hf_kwargs is only read when data.source is 'hf' (source is "
                             f"{self.source!r}), got {self.hf_kwargs}")
        if self.source in SPLIT_BY_OF_SOURCE and self.split_by not in ("auto", SPLIT_BY_OF_SOURCE[self.source][0]):
            by, how = SPLIT_BY_OF_SOURCE[self.source]
            raise ValueError(f"data.split_by={self.split_by!r} is not honoured by data.source={self.source!r}, "
                             f"which splits by {by} ({how}); set data.split_by to 'auto' or {by!r}")

    def resolved_cache_dir(self) -> Path:
        """The cache root: ``cache_dir``, else ``$COMERA_CACHE``, else ``~/.cache/comera-dist``."""
        root = self.cache_dir or os.environ.get("COMERA_CACHE") or "~/.cache/comera-dist"
        return Path(root).expanduser()
