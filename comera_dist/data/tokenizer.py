"""Training (``tokenizers``), saving and loading the ``PreTrainedTokenizerFast`` of a corpus."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import datasets
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from comera_dist.data import cache
from comera_dist.data.config import TokenizerConfig
from comera_dist.data.errors import DataError
from comera_dist.data.packing import separator_id

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
"""Ids 0-4 of every trained tokenizer, for both kinds. [CLS]/[SEP] double as BOS/EOS; [SEP]
also separates documents in the packed stream."""


def train_tokenizer(texts: datasets.Dataset, cfg: TokenizerConfig, *,
                    show_progress: bool = True) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE or WordPiece tokenizer on the ``text`` column of ``texts``.

    Reads documents in stored order until ``cfg.max_train_bytes`` of UTF-8 text.
    """
    if cfg.kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                      special_tokens=list(SPECIAL_TOKENS), show_progress=show_progress,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    else:
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.NFC()  # keep case: identifiers in code are case-sensitive
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency,
                                            special_tokens=list(SPECIAL_TOKENS), show_progress=show_progress)
    tok.train_from_iterator(_capped(texts, cfg.max_train_bytes), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                   bos_token="[CLS]", eos_token="[SEP]", model_max_length=10**9)


def tokenizer_key(corpus_key: str, cfg: TokenizerConfig) -> str:
    """The content key of a tokenizer: the corpus it learnt from and its settings (or its saved files)."""
    if cfg.pretrained is not None:
        root = pretrained_dir(cfg.pretrained)
        files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in root.iterdir() if p.is_file())
        return cache.content_key("tokenizer", {"pretrained": str(root), "files": files})
    return cache.content_key("tokenizer", {"corpus": corpus_key, "kind": cfg.kind, "vocab": cfg.vocab_size,
                                           "min_frequency": cfg.min_frequency,
                                           "max_train_bytes": cfg.max_train_bytes})


def obtain_tokenizer(train: datasets.Dataset | None, cfg: TokenizerConfig, *, corpus_key: str,
                     cache_root: Path, show_progress: bool = True) -> tuple[PreTrainedTokenizerBase, str]:
    """(tokenizer, key): a ``pretrained`` one, a cached one, or one trained on ``train`` and cached.

    ``train=None`` only loads (ranks that wait for the building rank).
    """
    key = tokenizer_key(corpus_key, cfg)
    if cfg.pretrained is not None:
        return load_tokenizer(pretrained_dir(cfg.pretrained)), key
    path = cache.entry_dir(cache_root, "tokenizer", key)
    if cache.read_meta(path) is None:
        if train is None:
            raise cache.missing_after_build(path)
        meta = {"kind": cfg.kind, "requested_vocab": cfg.vocab_size}
        with cache.publish(path, meta) as tmp:
            tok = train_tokenizer(train, cfg, show_progress=show_progress)
            tok.save_pretrained(str(tmp))
            meta["vocab"] = len(tok)
        log.info("tokenizer: trained %s (%d tokens)", path, meta["vocab"])
    return load_tokenizer(path), key


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """Load a saved tokenizer directory; a damaged cache entry is a ``CacheError`` naming it."""
    meta = cache.read_meta(path) if (path / cache.META).exists() else None
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # json/OS errors of a damaged directory
        if meta is not None:
            raise cache.unreadable(path, f"{type(e).__name__}: {e}") from e
        raise DataError(f"data.tokenizer.pretrained: cannot load a tokenizer from {path}: {e}") from e
    if meta is not None and meta.get("vocab") not in (None, len(tok)):
        raise cache.unreadable(path, f"vocabulary of {len(tok)} tokens, recorded {meta['vocab']}")
    return tok


def tokenizer_digest(tok: PreTrainedTokenizerBase) -> str:
    """sha256 of what decides the ids: a fast tokenizer's whole JSON (model with its vocabulary, normalizer,
    pre-tokenizer, special tokens), else its vocabulary. Two tokenizers with one digest encode alike."""
    if tok.is_fast:
        text = tok.backend_tokenizer.to_str()
    else:
        text = json.dumps([type(tok).__name__, sorted(tok.get_vocab().items())])
    return hashlib.sha256(text.encode()).hexdigest()


def tokenizer_files(tok: PreTrainedTokenizerBase) -> dict[str, bytes]:
    """The files ``save_pretrained`` writes, by name: a tokenizer as plain data, to send to other ranks."""
    with tempfile.TemporaryDirectory(prefix="comera-tokenizer-") as tmp:
        tok.save_pretrained(tmp)
        return {p.name: p.read_bytes() for p in sorted(Path(tmp).iterdir()) if p.is_file()}


def tokenizer_from_files(files: dict[str, bytes]) -> PreTrainedTokenizerBase:
    """The tokenizer ``tokenizer_files`` described (loaded into memory; nothing stays on disk)."""
    with tempfile.TemporaryDirectory(prefix="comera-tokenizer-") as tmp:
        for name, data in files.items():
            (Path(tmp) / Path(name).name).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp)


def save_run_tokenizer(tok: PreTrainedTokenizerBase, path: Path) -> None:
    """Write ``tok`` to ``path`` (a run's ``<run>/tokenizer``), atomically.

    One already there is kept when it is ``tok`` (same digest), and replaced when it is another (a fresh start
    in the directory of an earlier run): the old copy is moved aside, the new one renamed in, the old one
    deleted, so a crash leaves one of the two under ``path``, never neither."""
    if path.is_dir():
        with contextlib.suppress(DataError, OSError):
            if tokenizer_digest(load_tokenizer(path)) == tokenizer_digest(tok):
                return
        log.info("tokenizer: replacing %s, another run's", path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A plain mkdir, not mkdtemp: the published directory gets the mode (umask, default ACLs) of any directory
    # made there, as the checkpoints do, not mkdtemp's 0700 that locks teammates out of evaluating the run.
    tmp = path.parent / f".tokenizer-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    tok.save_pretrained(str(tmp))
    aside = None
    if path.is_dir():
        aside = Path(tempfile.mkdtemp(prefix=".tokenizer-old-", dir=path.parent))
        os.replace(path, aside / "tokenizer")
    os.replace(tmp, path)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def save_export_tokenizer(src: Path, out: Path, *, max_length: int, objective: str,
                          pair_type_id: int = 1) -> None:
    """Write the run tokenizer saved at ``src`` into ``out`` (an export directory), set for the exported model.

    The run's copy keeps ``model_max_length`` 10**9 (packing tokenizes whole documents); the export's is
    ``max_length`` (the model's ``max_positions``), so ``tok(text, truncation=True)`` fits its position table.
    An ``mlm`` run's blocks are ``[CLS] chunk [SEP]`` (``data/packing.py``), so its export adds them:
    ``[CLS] $A [SEP]``, pairs ``[CLS] $A [SEP] $B [SEP]`` with ``pair_type_id`` on the second segment (0 for a
    model with one token type). A ``causal`` run's blocks are plain windows of the document stream (each
    document's ids, then its ``[SEP]``), so a prompt's ids are its text's: its export adds no template."""
    tok = load_tokenizer(src)
    tok.model_max_length = max_length
    if objective == "mlm" and tok.is_fast:  # a slow (python) tokenizer adds its own [CLS]/[SEP]
        if tok.cls_token_id is None:
            raise DataError(f"tokenizer {src}: an mlm run's tokenizer has no cls_token")
        cls, sep = (tok.cls_token_id, separator_id(tok))
        names = tok.convert_ids_to_tokens([cls, sep])
        tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{names[0]} $A {names[1]}",
            pair=f"{names[0]} $A {names[1]} $B:{pair_type_id} {names[1]}:{pair_type_id}",
            special_tokens=[(names[0], cls), (names[1], sep)])
    tok.save_pretrained(str(out))


def pretrained_dir(name: str) -> Path:
    """``data.tokenizer.pretrained`` as an absolute directory; a ``DataError`` naming the key when it is none."""
    path = Path(name).expanduser()
    if not path.is_dir():
        raise DataError(f"data.tokenizer.pretrained: no such directory: {path}")
    return path.resolve()


def _capped(texts: datasets.Dataset, max_bytes: int) -> Iterator[list[str]]:
    seen = 0
    for start in range(0, len(texts), 256):
        batch = texts[start:start + 256]["text"]
        for i, t in enumerate(batch):
            seen += len(t.encode("utf-8", "surrogatepass"))
            if seen >= max_bytes:
                yield batch[:i + 1]
                return
        yield batch
