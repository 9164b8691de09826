"""The data pipeline's public entry points: ``prepare_data``, ``check_compat``, ``evaluation_corpus``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import datasets
from transformers import PreTrainedTokenizerBase

from comera_dist.data import cache, corpus, packing, sources
from comera_dist.data.collators import Collator, collator_for
from comera_dist.data.config import DataConfig
from comera_dist.data.errors import DataError
from comera_dist.data.tokenizer import obtain_tokenizer, tokenizer_digest, tokenizer_key

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class PreparedData:
    """Everything training needs from the data side."""

    train: datasets.Dataset
    """Packed training blocks, column ``input_ids`` of ``seq_len`` int32 each."""
    validation: datasets.Dataset
    """Packed validation blocks (same layout)."""
    tokenizer: PreTrainedTokenizerBase
    """The tokenizer the blocks were made with."""
    vocab_size: int
    """``len(tokenizer)``: every id in the blocks is below it."""
    collator: Collator
    """The collator of ``cfg.objective`` (MLM masking or causal labels)."""
    cache_path: Path
    """The cache entry holding the packed blocks."""


def prepare_data(cfg: DataConfig, *, rank: int = 0, world_size: int = 1, show_progress: bool = True,
                 barrier: Callable[[], None] | None = None,
                 tokenizer: PreTrainedTokenizerBase | None = None) -> PreparedData:
    """Build (or load from cache) corpus, tokenizer and packed blocks.

    In a multi-process run every rank calls this with a ``barrier`` (e.g.
    ``deepspeed.comm.barrier``): rank 0 builds while the others wait, then they load the
    published cache entries. Pass the *local* rank when ``cache_dir`` is node-local. Progress
    bars show on rank 0 only.

    ``tokenizer``: pack with this one instead of the cached or trained one (``prepare_tokenizer``'s, sent
    from one rank to all: WordPiece training is not repeatable, so two nodes' caches can hold different
    tokenizers under one key). Blocks are cached by the digest of the tokenizer that made them.
    """
    if not 0 <= rank < world_size:
        raise DataError(f"prepare_data: rank={rank} not in [0, world_size={world_size})")
    if world_size > 1 and barrier is None:
        raise DataError(f"prepare_data: world_size={world_size} needs a barrier callable "
                        "(e.g. deepspeed.comm.barrier) so that only rank 0 builds the cache")
    builder = rank == 0
    if not builder:
        barrier()  # type: ignore[misc]  # wait until rank 0 has published every entry
    try:
        show = show_progress and builder
        with cache.datasets_progress(show):
            out = _prepare(cfg, build=builder, show_progress=show, tokenizer=tokenizer)
    finally:
        if builder and barrier is not None:
            barrier()  # release the waiting ranks (also on failure, so they fail fast on the missing entry)
    return out


def prepare_tokenizer(cfg: DataConfig, *, show_progress: bool = True) -> PreTrainedTokenizerBase:
    """The tokenizer of ``cfg`` in this process: ``pretrained``, cached, or trained (building the corpus first
    when it is not cached). One process of a run calls it; ``prepare_data(tokenizer=...)`` packs with it."""
    with cache.datasets_progress(show_progress):
        tokenizer, _ = _tokenizer(cfg, cfg.resolved_cache_dir(), corpus.corpus_plan(cfg)[0], build=True,
                                  show_progress=show_progress)
    return tokenizer


def _tokenizer(cfg: DataConfig, root: Path, corpus_key: str, *, build: bool,
               show_progress: bool) -> tuple[PreTrainedTokenizerBase, datasets.DatasetDict | None]:
    """(tokenizer, the corpus if it had to be read to train it)."""
    tok_path = cache.entry_dir(root, "tokenizer", tokenizer_key(corpus_key, cfg.tokenizer))
    docs = None
    if build and cfg.tokenizer.pretrained is None and cache.read_meta(tok_path) is None:
        docs = corpus.build_corpus(cfg, root, show_progress=show_progress)
    tokenizer, _ = obtain_tokenizer(docs["train"] if docs is not None else None, cfg.tokenizer,
                                    corpus_key=corpus_key, cache_root=root, show_progress=show_progress)
    return tokenizer, docs


def _prepare(cfg: DataConfig, *, build: bool, show_progress: bool,
             tokenizer: PreTrainedTokenizerBase | None) -> PreparedData:
    root = cfg.resolved_cache_dir()
    corpus_key, _ = corpus.corpus_plan(cfg)
    docs = None
    if tokenizer is None:
        tokenizer, docs = _tokenizer(cfg, root, corpus_key, build=build, show_progress=show_progress)
    blocks_path = cache.entry_dir(root, "blocks", cache.content_key(
        "blocks", {"tokenizer": tokenizer_digest(tokenizer), "corpus": corpus_key, "seq_len": cfg.seq_len,
                   "objective": cfg.objective, "layout": packing.LAYOUT_VERSION}))
    if cache.read_meta(blocks_path) is None:
        if not build:
            raise cache.missing_after_build(blocks_path)
        if docs is None:
            docs = corpus.build_corpus(cfg, root, show_progress=show_progress)
        meta: dict = {"seq_len": cfg.seq_len, "objective": cfg.objective}
        with cache.publish(blocks_path, meta) as tmp:
            packed = datasets.DatasetDict({
                name: packing.pack(docs[name], tokenizer, seq_len=cfg.seq_len, objective=cfg.objective,
                                   desc=f"tokenizing {name}", show_progress=show_progress)
                for name in ("train", "validation")})
            packed.save_to_disk(str(tmp))
            meta["rows"] = {name: len(ds) for name, ds in packed.items()}
        log.info("blocks: built %s (%s)", blocks_path, meta["rows"])
    packed = corpus.load_entry(blocks_path)
    return PreparedData(train=packed["train"], validation=packed["validation"], tokenizer=tokenizer,
                        vocab_size=len(tokenizer), cache_path=blocks_path,
                        collator=collator_for(cfg.objective, tokenizer, cfg.mlm_probability))


def check_compat(data_cfg: DataConfig, vocab_size: int, max_positions: int, *,
                 tokenizer: PreTrainedTokenizerBase | None = None) -> None:
    """Refuse a model that cannot consume this data: ``seq_len > max_positions`` or a vocabulary
    smaller than the tokenizer's.

    Without ``tokenizer`` (before the data is built) the configured ``tokenizer.vocab_size`` is the
    bound (a trained tokenizer never exceeds it). A model vocabulary *larger* than the tokenizer's
    is accepted: its extra rows are never indexed (models pad vocabularies to friendly sizes).
    """
    if data_cfg.seq_len > max_positions:
        raise DataError(f"data.seq_len={data_cfg.seq_len} exceeds the model's max_positions={max_positions}; "
                        "lower data.seq_len or raise model.max_positions")
    if tokenizer is not None:
        need, what = len(tokenizer), f"the tokenizer's vocabulary ({len(tokenizer)} tokens)"
    elif data_cfg.tokenizer.pretrained is not None:
        return  # unknown until loaded; the engine calls again with the tokenizer
    else:
        need, what = data_cfg.tokenizer.vocab_size, f"data.tokenizer.vocab_size={data_cfg.tokenizer.vocab_size}"
    if vocab_size < need:
        raise DataError(f"model vocab_size={vocab_size} is smaller than {what}: token ids up to {need - 1} "
                        "would index past the embedding; set model.vocab_size >= that")


def evaluation_corpus(paths: Sequence[str | Path], tokenizer: PreTrainedTokenizerBase, *, seq_len: int,
                      objective: str = "mlm", text_column: str = "text", show_progress: bool = True,
                      cache_dir: Path | None = None, column_setting: str = "the evaluation's text column",
                      too_short: str = "add text or lower data.seq_len") -> datasets.Dataset:
    """Packed blocks from any local corpus: files or directories of .py/.txt/.md/.json/.jsonl/.parquet.

    Text-like files are whole documents; JSON/Parquet rows give ``text_column``. Not cached. Nothing
    configures the builder here, so its errors name the file, not ``data.*`` keys; ``column_setting`` is what
    chose ``text_column``, for its errors; ``too_short``: ``pack``'s remedy for a corpus that makes no block (``comera evaluate``'s ``seq_len``
    is its checkpoint's, not the user's to lower).
    """
    files = sources.resolve_paths([str(p) for p in paths], where="evaluation paths")
    groups: dict[str, list[Path]] = {}
    for f in files:
        groups.setdefault(_evaluation_builder(f), []).append(f)
    parts = []
    for builder, group in sorted(groups.items()):
        if builder == "text":
            texts = [sources.read_text_file(f)[0] for f in group]
            parts.append(datasets.Dataset.from_dict({"text": texts},
                                                    features=datasets.Features(text=datasets.Value("string"))))
        else:
            hf_cache = cache_dir or DataConfig().resolved_cache_dir()
            with cache.datasets_progress(show_progress):  # its "Generating train split" bar, kept out of a log
                parts.append(sources.load_files(group, builder=builder, text_column=text_column,
                                                sample_by="document", cache_dir=hf_cache / "hf", num_proc=1,
                                                setting=column_setting))
    docs = sources.drop_blank(datasets.concatenate_datasets(parts))
    if len(docs) == 0:
        raise DataError(f"empty corpus: the evaluation paths {[str(p) for p in paths]} hold no non-blank text")
    return packing.pack(docs, tokenizer, seq_len=seq_len, objective=objective, desc="tokenizing evaluation",
                        show_progress=show_progress, too_short=too_short)


def _evaluation_builder(path: Path) -> str:
    """The ``datasets`` builder of an evaluation file, by its extension alone (there is no builder to set)."""
    builder = sources.BUILDER_BY_SUFFIX.get(path.suffix)
    if builder is None:
        kind = repr(path.suffix) if path.suffix else "extension-less"
        raise DataError(f"evaluation file {path}: cannot read {kind} files; "
                        f"convert it to one of {', '.join(sorted(sources.BUILDER_BY_SUFFIX))} or leave it out")
    return builder
