"""The train/validation text corpus of a ``DataConfig``, built once and cached on disk by content."""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path
from typing import Any

import datasets
from tqdm.auto import tqdm

from comera_dist.data import cache, sources
from comera_dist.data.config import DataConfig
from comera_dist.data.errors import DataError

log = logging.getLogger(__name__)
TEXT_FEATURES = datasets.Features(text=datasets.Value("string"))
"""The schema every corpus split has (the stdlib adds ``path``)."""


def corpus_plan(cfg: DataConfig) -> tuple[str, dict[str, Any]]:
    """The cache key of ``cfg``'s corpus and what the build needs (cheap: lists and stats files only).

    The key covers everything the corpus content depends on: for file sources the list of
    files with their sizes and modification times, plus the split and cap settings; for ``hf`` the
    ``load_dataset`` arguments and the same stats of every local file they name (``_hf_local_stats``).
    """
    split = {"fraction": cfg.validation_fraction, "salt": cfg.split_salt, "max_files": cfg.max_files}
    if cfg.source == "stdlib":
        root = sources.stdlib_root()
        train, val = sources.split_keys(sources.list_stdlib_files(root), fraction=cfg.validation_fraction,
                                        salt=cfg.split_salt, max_keys=cfg.max_files)
        plan = {"source": "stdlib", "root": str(root), "train": train, "validation": val,
                "filters": f"*.py under {root} outside {sorted(sources.EXCLUDED_DIRS)}, "
                           f"max_files={cfg.max_files}"}
        payload = {**split, "source": "stdlib", "stats": _stats(root, train + val)}
    elif cfg.source == "files":
        paths = sources.resolve_paths(cfg.files)
        builder = sources.infer_builder(paths, cfg.builder)
        root = Path(os.path.commonpath(paths)) if len(paths) > 1 else paths[0].parent
        rel = [p.relative_to(root).as_posix() for p in paths]
        train, val = sources.split_keys(rel, fraction=cfg.validation_fraction, salt=cfg.split_salt,
                                        max_keys=cfg.max_files)
        by_file = cfg.split_by == "file" or (cfg.split_by == "auto" and bool(train) and bool(val))
        if not by_file:  # every file is read; documents are split by content hash
            ranked = sorted(rel, key=lambda k: sources.split_unit(k, cfg.split_salt + "/order"))
            train, val = sorted(ranked[:cfg.max_files]), []
        plan = {"source": "files", "root": str(root), "builder": builder, "train": train, "validation": val,
                "by_file": by_file, "filters": f"files {cfg.files}, builder={builder}, "
                                              f"text_column={cfg.text_column!r}, max_files={cfg.max_files}"}
        payload = {**split, "source": "files", "builder": builder, "by_file": by_file,
                   "text_column": cfg.text_column, "sample_by": cfg.sample_by,
                   "stats": _stats(root, sorted(train + val))}
    else:
        plan = {"source": "hf", "filters": f"load_dataset(**{cfg.hf_kwargs}), column {cfg.text_column!r}"}
        payload = {**split, "source": "hf", "kwargs": cfg.hf_kwargs, "text_column": cfg.text_column,
                   "local": _hf_local_stats(cfg.hf_kwargs)}
    return cache.content_key("corpus", payload), plan


def build_corpus(cfg: DataConfig, cache_root: Path, *, show_progress: bool = True,
                 build: bool = True) -> datasets.DatasetDict:
    """The ``DatasetDict(train, validation)`` of documents (column ``text``), from cache or built.

    ``build=False`` only loads (the non-building ranks of a multi-process run) and raises
    ``CacheError`` when the entry is missing.
    """
    key, plan = corpus_plan(cfg)
    path = cache.entry_dir(cache_root, "corpus", key)
    meta = cache.read_meta(path)
    if meta is None:
        if not build:
            raise cache.missing_after_build(path)
        meta = {"filters": plan["filters"]}
        with cache.publish(path, meta) as tmp:
            corpus = _materialize(cfg, plan, cache_root, show_progress)
            _check_nonempty(corpus, plan, cfg)
            corpus.save_to_disk(str(tmp))
            meta["rows"] = {name: len(ds) for name, ds in corpus.items()}
        log.info("corpus: built %s (%s rows)", path, meta["rows"])
    else:
        log.info("corpus: cache hit %s", path)
    return load_entry(path)


def load_entry(path: Path) -> datasets.DatasetDict | datasets.Dataset:
    """Load a saved Dataset(Dict) entry, turning any failure into a ``CacheError`` naming ``path``.

    The row counts recorded at build time are checked and the first and last rows read, so a
    damaged entry fails here rather than in the middle of training.
    """
    meta = cache.read_meta(path)
    if meta is None:
        raise cache.unreadable(path, "no such entry")
    try:
        loaded = datasets.load_from_disk(str(path))
        splits = loaded if isinstance(loaded, datasets.DatasetDict) else {"": loaded}
        rows = {name: len(ds) for name, ds in splits.items()}
        for ds in splits.values():
            if len(ds):
                ds[0], ds[len(ds) - 1]
    except Exception as e:  # arrow/json/OS errors of a damaged entry
        raise cache.unreadable(path, f"{type(e).__name__}: {e}") from e
    if "rows" in meta and meta["rows"] != rows:
        raise cache.unreadable(path, f"row counts {rows} differ from the recorded {meta['rows']}")
    return loaded


HF_LOCAL_KWARGS = ("path", "data_dir", "data_files")
"""The ``load_dataset`` arguments that may name local files or directories."""


def _hf_local_stats(kwargs: dict[str, Any]) -> list[tuple[str, int, int]]:
    """(path, size, mtime) of every local file that ``load_dataset(**kwargs)`` may read: each string under
    ``HF_LOCAL_KWARGS`` (also inside lists and split dicts) that names an existing file, a directory (every
    file below it) or a glob pattern. A hub dataset's name matches nothing."""
    found: set[Path] = set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, (str, os.PathLike)):
            spec = os.path.expanduser(os.fspath(value))
            for name in glob.glob(spec, recursive=True) if glob.has_magic(spec) else [spec]:
                p = Path(name)
                if p.is_file():
                    found.add(p)
                elif p.is_dir():
                    found.update(q for q in p.rglob("*") if q.is_file())

    for key in HF_LOCAL_KWARGS:
        walk(kwargs.get(key))
    return [(str(p), st.st_size, st.st_mtime_ns) for p in sorted(found) for st in [p.stat()]]


def _stats(root: Path, rel: list[str]) -> list[tuple[str, int, int]]:
    stats = []
    for r in rel:
        st = (root / r).stat()
        stats.append((r, st.st_size, st.st_mtime_ns))
    return stats


def _materialize(cfg: DataConfig, plan: dict[str, Any], cache_root: Path,
                 show_progress: bool) -> datasets.DatasetDict:
    hf_cache = cache_root / "hf"
    if plan["source"] == "stdlib":
        return datasets.DatasetDict({name: _read_python(Path(plan["root"]), plan[name], name, show_progress)
                                     for name in ("train", "validation")})
    if plan["source"] == "files":
        root = Path(plan["root"])

        def load(rel: list[str]) -> datasets.Dataset:
            if not rel:  # a split with no file; reported by _check_nonempty with the fix
                return datasets.Dataset.from_dict({"text": []}, features=TEXT_FEATURES)
            return sources.load_files([root / r for r in rel], builder=plan["builder"],
                                      text_column=cfg.text_column, sample_by=cfg.sample_by,
                                      cache_dir=hf_cache, num_proc=cfg.num_proc)

        if plan["by_file"]:
            return datasets.DatasetDict(train=sources.drop_blank(load(plan["train"])),
                                        validation=sources.drop_blank(load(plan["validation"])))
        everything = sources.drop_blank(load(plan["train"]))
        return sources.split_documents(everything, fraction=cfg.validation_fraction, salt=cfg.split_salt)
    return _load_hf(cfg, hf_cache)


def _read_python(root: Path, rel: list[str], split: str, show_progress: bool) -> datasets.Dataset:
    texts, replaced = [], 0
    for r in tqdm(rel, desc=f"reading {split} files", unit="file", disable=not show_progress):
        text, lossy = sources.read_text_file(root / r)
        texts.append(text)
        replaced += lossy
    if replaced:
        log.info("corpus: %d %s file(s) were not valid in their encoding; bad bytes became U+FFFD",
                 replaced, split)
    ds = datasets.Dataset.from_dict({"text": texts, "path": rel},
                                    features=datasets.Features(path=datasets.Value("string"), **TEXT_FEATURES))
    return sources.drop_blank(ds)


def _load_hf(cfg: DataConfig, hf_cache: Path) -> datasets.DatasetDict:
    kwargs = {"num_proc": cfg.num_proc if cfg.num_proc > 1 else None, **cfg.hf_kwargs}
    kwargs.setdefault("cache_dir", str(hf_cache))
    try:
        loaded = datasets.load_dataset(**kwargs)
    except Exception as e:  # offline hub names, missing files, bad kwargs: report what was asked
        raise DataError(f"data.hf_kwargs={cfg.hf_kwargs}: load_dataset failed: {type(e).__name__}: {e}") from e
    if isinstance(loaded, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise DataError(f"data.hf_kwargs={cfg.hf_kwargs}: streaming datasets cannot be packed and cached; "
                        "drop 'streaming' (or select a slice with split='train[:N]')")
    where = f"load_dataset(**{cfg.hf_kwargs})"
    if isinstance(loaded, datasets.DatasetDict):
        if "train" in loaded and "validation" in loaded:
            return datasets.DatasetDict({s: sources.drop_blank(sources.text_only(loaded[s], cfg.text_column,
                                                                                 where=where))
                                         for s in ("train", "validation")})
        if "train" not in loaded and len(loaded) != 1:
            raise DataError(f"data.hf_kwargs: {where} returned splits {list(loaded)}; pick one with 'split'")
        loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    docs = sources.drop_blank(sources.text_only(loaded, cfg.text_column, where=where))
    return sources.split_documents(docs, fraction=cfg.validation_fraction, salt=cfg.split_salt)


def _check_nonempty(corpus: datasets.DatasetDict, plan: dict[str, Any], cfg: DataConfig) -> None:
    for name in ("train", "validation"):
        if len(corpus[name]) == 0:
            hint = ("" if name == "train" else
                    f"; raise data.validation_fraction (now {cfg.validation_fraction}) or add documents")
            raise DataError(f"empty corpus: the {name} split has no non-blank documents "
                            f"(source {plan['source']!r}: {plan['filters']}){hint}")
