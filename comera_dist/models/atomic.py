"""Atomic output directories: write into a hidden sibling, then rename into place.

A crash mid-export leaves at most a ``.<name>.tmp-<pid>`` sibling, never a half-written
``out_dir`` (an existing ``out_dir`` is replaced only after the new one is complete).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def umask_modes(root: Path) -> None:
    """Give every file under ``root`` the mode a plain ``open`` makes (``0o666`` less the umask). safetensors writes
    its file ``0o600`` whatever the umask: an export beside its ``0o644`` config, unreadable to a team."""
    mask = os.umask(0)
    os.umask(mask)
    mode = 0o666 & ~mask
    for path in Path(root).rglob("*"):
        if path.is_file() and not path.is_symlink() and path.stat().st_mode & 0o777 != mode:
            path.chmod(mode)


@contextlib.contextmanager
def atomic_dir(out_dir: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary directory; on success it becomes ``out_dir``."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"output path {out} exists and is not a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    umask_modes(tmp)
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    if out.exists():
        out.rename(old)
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
