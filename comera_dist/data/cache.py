"""Content-keyed, atomically published cache entries (one directory per artifact)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets

from comera_dist.data.errors import CacheError

META = "comera_meta.json"
"""Written last inside an entry: its presence marks a complete entry."""
FORMAT_VERSION = 1
"""Bump when the layout of any cached artifact changes; old entries are then ignored."""


def content_key(kind: str, payload: Any) -> str:
    """A stable short hash of ``payload`` (JSON-serializable) for an artifact of ``kind``."""
    text = json.dumps({"kind": kind, "version": FORMAT_VERSION, "payload": payload},
                      sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def entry_dir(root: Path, kind: str, key: str) -> Path:
    """Where the entry of ``kind`` with ``key`` lives under cache root ``root``."""
    return root / f"{kind}-{key}"


def read_meta(path: Path) -> dict[str, Any] | None:
    """The metadata of a complete entry; ``None`` if there is no entry; ``CacheError`` if it is broken."""
    if not path.exists():
        return None
    meta_file = path / META
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:
        raise unreadable(path, f"{meta_file.name}: {e}") from e
    if not isinstance(meta, dict):
        raise unreadable(path, f"{meta_file.name}: expected a JSON object, got {type(meta).__name__}")
    return meta


def unreadable(path: Path, why: str) -> CacheError:
    """The error for a broken entry at ``path`` (we never delete user-visible data silently)."""
    return CacheError(f"unreadable cache entry {path} ({why}); delete it to rebuild: rm -rf '{path}'")


def missing_after_build(path: Path) -> CacheError:
    """The error of a rank that waited for the building rank and still finds no entry at ``path``."""
    return CacheError(f"cache entry {path} is missing after the building rank finished: it may have failed "
                      "(see its error), or cache_dir is not shared by all ranks of this node")


@contextlib.contextmanager
def publish(final: Path, meta: dict[str, Any]) -> Iterator[Path]:
    """Build an entry in a temporary sibling directory, then rename it to ``final`` in one step.

    Yields the temporary directory to fill. On an exception the temporary directory is removed
    and ``final`` is untouched, so an interrupted build never leaves a half entry. If another
    process published ``final`` first, its entry is kept and ours discarded (same content key).
    """
    tmp = final.parent / f".{final.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_builds(final)
        lock = open(_lock_of(tmp), "w")  # noqa: SIM115 - held for the whole build, closed below
    except OSError as e:  # a read-only or foreign cache directory: bad input, not a traceback at the first build
        raise CacheError(f"data.cache_dir: cannot build the cache entry {final}: {e.strerror or e} (point "
                         "data.cache_dir at a directory this user can write)") from e
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # while held, no other build takes this one for a dead one's
        tmp.mkdir()
        yield tmp
        (tmp / META).write_text(json.dumps(meta, sort_keys=True, indent=1, default=str))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / META).exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        _lock_of(tmp).unlink(missing_ok=True)
        lock.close()


def remove_stale_builds(final: Path) -> list[Path]:
    """Delete temporary build directories of ``final`` left by killed processes of this host.

    Only directories whose recorded process no longer exists here, and whose lock (``<dir>.lock``, held by its
    build from before the directory exists until it is published) is free, are removed. Builds of other hosts (a
    shared file system) and live builds are left alone, a live build in another PID namespace of this host too (a
    container with the host's network, and so its name, where its pid means nothing here). Returns what was
    removed.
    """
    host, removed = socket.gethostname(), []
    for tmp in final.parent.glob(f".{final.name}.tmp-*"):
        if tmp.suffix == ".lock":
            continue
        tail = tmp.name[len(f".{final.name}.tmp-"):]
        owner, _, rest = tail.rpartition("-")[0].rpartition("-")  # "<host>-<pid>-<uuid>"
        if owner == host and rest.isdigit() and not _alive(int(rest)) and _lock_free(_lock_of(tmp)):
            shutil.rmtree(tmp, ignore_errors=True)
            _lock_of(tmp).unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _lock_of(tmp: Path) -> Path:
    return tmp.with_name(tmp.name + ".lock")


def _lock_free(path: Path) -> bool:
    """Whether no process holds the build lock at ``path`` (free too when there is none: a build of an older
    version, or one killed before its lock was written)."""
    try:
        with open(path) as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except FileNotFoundError:
        return True
    except OSError:
        return False  # held
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


@contextlib.contextmanager
def datasets_progress(show: bool) -> Iterator[None]:
    """Show or hide ``datasets``' own progress bars (save/load) for the duration, then restore."""
    was = datasets.is_progress_bar_enabled()
    (datasets.enable_progress_bars if show else datasets.disable_progress_bars)()
    try:
        yield
    finally:
        (datasets.enable_progress_bars if was else datasets.disable_progress_bars)()
