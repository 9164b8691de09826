"""Finding, reading and hash-splitting the raw documents of every corpus source."""

from __future__ import annotations

import glob
import hashlib
import os
import sysconfig
import tokenize
from collections.abc import Iterable, Sequence
from pathlib import Path

import datasets

from comera_dist.data.errors import DataError

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
"""Directory names never read from the stdlib root (third-party code, bytecode)."""
BUILDER_BY_SUFFIX = {".py": "text", ".txt": "text", ".md": "text", ".rst": "text",
                     ".json": "json", ".jsonl": "json", ".parquet": "parquet"}
"""The ``datasets`` builder for each file extension found in a directory."""


def stdlib_root() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_files(root: Path) -> list[str]:
    """Every ``.py`` file under ``root`` outside site-packages, as sorted POSIX paths relative to ``root``."""
    if not root.is_dir():
        raise DataError(f"stdlib root is not a directory: {root}")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        rel = Path(dirpath).relative_to(root)
        found.extend((rel / f).as_posix() for f in filenames if f.endswith(".py"))
    return sorted(found)


def split_unit(key: str, salt: str) -> float:
    """A uniform number in [0, 1) from ``key``: the same on every machine and Python version."""
    digest = hashlib.sha256(f"{salt}\0{key}".encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def split_keys(keys: Sequence[str], *, fraction: float, salt: str,
               max_keys: int | None = None) -> tuple[list[str], list[str]]:
    """Deterministically split ``keys`` into (train, validation) by hash.

    With ``max_keys``, each split keeps its lowest-hash members in proportion (at least one
    each), so a tiny capped run still has both splits and sees a spread of files.
    """
    ranked = sorted(keys, key=lambda k: (split_unit(k, salt + "/order"), k))
    val = [k for k in ranked if split_unit(k, salt) < fraction]
    train = [k for k in ranked if split_unit(k, salt) >= fraction]
    if max_keys is not None:
        n_val = min(len(val), max(1, round(max_keys * fraction)))
        val, train = val[:n_val], train[:max_keys - n_val]
    return sorted(train), sorted(val)


def read_text_file(path: Path) -> tuple[str, bool]:
    """The text of ``path`` and whether undecodable bytes were replaced.

    Python files honour their PEP 263 encoding cookie (``tokenize.open``); anything that
    still fails to decode (or any other file) is read as UTF-8 with U+FFFD replacements.
    Line endings ``\\r\\n`` and ``\\r`` become ``\\n``, as the ``datasets`` text builder (a text-mode
    ``open``) reads them, so a file tokenizes alike whichever of the two read it.
    """
    if path.suffix == ".py":
        try:
            with tokenize.open(path) as f:
                return f.read(), False
        except (SyntaxError, UnicodeDecodeError, LookupError):
            pass  # bad or unknown cookie, or bytes invalid in the declared encoding
    data = path.read_bytes()
    try:
        text, lossy = data.decode("utf-8"), False
    except UnicodeDecodeError:
        text, lossy = data.decode("utf-8", errors="replace"), True
    return universal_newlines(text), lossy


def universal_newlines(text: str) -> str:
    """``text`` with ``\\r\\n`` and lone ``\\r`` turned into ``\\n`` (Python's text-mode reading)."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def resolve_paths(patterns: Iterable[str], *, where: str = "data.files") -> list[Path]:
    """Expand files, directories (recursively, known extensions only) and globs (a name that exists as given is
    taken literally, brackets and all); missing ones are errors."""
    out: list[Path] = []
    for pattern in patterns:
        path = Path(pattern).expanduser()
        if glob.has_magic(pattern) and not path.exists():  # "run[1].txt" may be a file's own name
            matches = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
            if not matches:
                raise DataError(f"{where}: the pattern {pattern!r} matches no files")
            out.extend(matches)
        elif path.is_dir():
            matches = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in BUILDER_BY_SUFFIX
                             and not EXCLUDED_DIRS.intersection(p.relative_to(path).parts))
            if not matches:
                raise DataError(f"{where}: the directory {path} holds no files with a known extension "
                                f"{sorted(BUILDER_BY_SUFFIX)}")
            out.extend(matches)
        elif path.is_file():
            out.append(path)
        else:
            raise DataError(f"{where}: no such file or directory: {path}")
    return sorted(dict.fromkeys(p.resolve() for p in out))


def infer_builder(paths: Sequence[Path], builder: str | None, *, where: str = "data.builder") -> str:
    """The one ``datasets`` builder for ``paths``: the given one, or the one their extensions imply."""
    if builder is not None:
        return builder
    kinds = {BUILDER_BY_SUFFIX.get(p.suffix) for p in paths}
    if None in kinds:
        odd = sorted({p.suffix for p in paths if p.suffix not in BUILDER_BY_SUFFIX})
        raise DataError(f"{where}: cannot infer a builder for extensions {odd}; set it to text/json/parquet")
    if len(kinds) > 1:
        raise DataError(f"{where}: files mix builders {sorted(kinds)}; list one kind or set {where}")
    return kinds.pop()


def load_files(paths: Sequence[Path], *, builder: str, text_column: str, sample_by: str,
               cache_dir: Path, num_proc: int, setting: str = "data.text_column") -> datasets.Dataset:
    """Load ``paths`` with ``datasets.load_dataset(builder, ...)`` into one ``text`` column (``setting``:
    ``text_only``'s)."""
    # datasets reads data_files as glob patterns: a file named "run[1].txt" matched nothing, an empty dataset
    kwargs: dict = {"data_files": [glob.escape(str(p)) for p in paths], "split": "train",
                    "cache_dir": str(cache_dir), "num_proc": num_proc if len(paths) > 1 else None}
    if builder == "text":
        kwargs.update(sample_by=sample_by, encoding_errors="replace")
    try:
        ds = datasets.load_dataset(builder, **kwargs)
    except Exception as e:  # datasets raises many types; the file that fails is what the user needs
        raise load_failure(paths, builder, kwargs, e) from e
    return text_only(ds, text_column, where=f"files {paths[0]} ...", setting=setting)


def load_failure(paths: Sequence[Path], builder: str, kwargs: dict, error: Exception) -> DataError:
    """The error of a failed ``load_dataset(builder, **kwargs)`` over ``paths``, naming the first file that
    fails on its own (each one is loaded alone to find it), else saying that they fail only together."""
    def failure(files: str, e: Exception) -> DataError:
        cause = e.__cause__  # datasets wraps the parser's error in "An error occurred while generating ..."
        why = f"{type(e).__name__}: {e}" + (f" ({type(cause).__name__}: {cause})" if cause else "")
        return DataError(f"load_dataset({builder!r}) failed on {files}: {why}")

    if len(paths) == 1:
        return failure(str(paths[0]), error)
    for path in paths:
        try:
            datasets.load_dataset(builder, **{**kwargs, "data_files": [glob.escape(str(path))], "num_proc": None})
        except Exception as e:  # noqa: BLE001 - any failure of this file alone names it
            return failure(f"{path} (one of {len(paths)} files)", e)
    return failure(f"{len(paths)} files together, though each loads alone (do their columns or types "
                   f"differ?), first {paths[0]}", error)


def text_only(ds: datasets.Dataset, text_column: str, *, where: str,
              setting: str = "data.text_column") -> datasets.Dataset:
    """Keep only ``text_column`` (renamed ``text``); a missing or non-string column is an error naming
    ``setting``, what chose the column (a caller without that config key names its own)."""
    if text_column not in ds.column_names:
        raise DataError(f"{setting} {text_column!r} is not a column of {where}; "
                        f"columns: {ds.column_names}")
    feature = ds.features[text_column]
    if getattr(feature, "dtype", None) not in ("string", "large_string"):
        raise DataError(f"{setting} {text_column!r} of {where} holds {feature}, not strings")
    ds = ds.select_columns([text_column])
    return ds.rename_column(text_column, "text") if text_column != "text" else ds


def split_documents(ds: datasets.Dataset, *, fraction: float, salt: str) -> datasets.DatasetDict:
    """Split rows by a hash of their text (identical documents land in the same split)."""
    is_val = [split_unit(t, salt) < fraction for t in ds["text"]]
    train = [i for i, v in enumerate(is_val) if not v]
    val = [i for i, v in enumerate(is_val) if v]
    return datasets.DatasetDict(train=ds.select(train), validation=ds.select(val))


def drop_blank(ds: datasets.Dataset) -> datasets.Dataset:
    """Remove documents that are empty or whitespace only."""
    keep = [i for i, t in enumerate(ds["text"]) if t is not None and t.strip()]
    return ds if len(keep) == len(ds) else ds.select(keep)
