"""Sharded DeepSpeed checkpoints with atomic publication, a completeness marker and ``resume auto``.

Layout under ``<output_dir>/checkpoints``::

    step00000012/            one published checkpoint (DeepSpeed's per-rank files)
        comera_meta.json     shapes (pruning plans), config identity, step: read BEFORE the engine exists
        config.yaml          the resolved run config
        COMPLETE             written last, before the rename: the checkpoint is whole
    latest                   the tag of the newest complete checkpoint (DeepSpeed's format)

All ranks call ``engine.save_checkpoint`` under a temporary tag ``.tmp-<tag>``; after a
barrier, rank 0 adds the side files and the marker, renames the directory to its final tag
and replaces ``latest`` through a temporary file + ``os.replace``. A crash at any point
leaves ``latest`` on the previous complete checkpoint; leftovers of temporary tags are
ignored by ``resume auto`` and removed by the next save.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import deepspeed.comm as dist
import torch
import yaml
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

MARKER = "COMPLETE"
META = "comera_meta.json"
CONFIG = "config.yaml"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
_TAG = re.compile(r"^step(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or incompatible with this run; the message says which and why."""


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(engine, root: Path, step: int, *, client_state: dict[str, Any], meta: dict[str, Any],
         resolved_config: dict[str, Any], keep: int, before_publish=None) -> Path:
    """Save a checkpoint of ``engine`` at ``step`` (collective) and publish it atomically; returns its dir.

    ``before_publish`` (tests): called on rank 0 after every rank has written, before the marker.
    """
    root = Path(root)
    tag = tag_for(step)
    tmp_tag = TMP_PREFIX + tag
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(root / tmp_tag, ignore_errors=True)  # a crashed earlier attempt
    dist.barrier()
    engine.save_checkpoint(str(root), tag=tmp_tag, client_state=client_state, save_latest=False)
    dist.barrier()  # every rank's shards are on disk
    final = root / tag
    if rank == 0:
        tmp_dir = root / tmp_tag
        (tmp_dir / META).write_text(json.dumps({**meta, "step": step, "tag": tag}, indent=2))
        (tmp_dir / CONFIG).write_text(yaml.safe_dump(resolved_config, sort_keys=False))
        if before_publish is not None:
            before_publish(tmp_dir)
        _write_atomic(tmp_dir / MARKER, f"{tag}\n")
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.rename(tmp_dir, final)
        _fsync_dir(root)
        _write_atomic(root / LATEST, tag)
        _fsync_dir(root)
        _remove_old(root, keep)
    dist.barrier()
    return final


def _remove_old(root: Path, keep: int) -> None:
    done = complete_checkpoints(root)
    for path in done[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    for path in root.glob(TMP_PREFIX + "*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)


def is_complete(path: Path) -> bool:
    return (Path(path) / MARKER).is_file() and (Path(path) / META).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _TAG.match(p.name) and is_complete(p)]
    return sorted(found, key=lambda p: int(_TAG.match(p.name).group(1)))


def latest_complete(root: Path) -> Path | None:
    """The checkpoint ``latest`` names if it is complete, else the newest complete one, else None."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if is_complete(named):
            return named
    done = complete_checkpoints(root)
    return done[-1] if done else None


def resolve(spec: str, root: Path) -> Path | None:
    """``none`` -> None; ``auto`` -> the latest complete checkpoint under ``root`` (or None); else that path."""
    if spec == "none":
        return None
    if spec == "auto":
        return latest_complete(root)
    path = Path(spec)
    if path.is_dir() and not is_complete(path) and latest_complete(path) is not None:
        return latest_complete(path)  # a checkpoints root was given
    if not path.is_dir():
        raise CheckpointError(f"resume: checkpoint directory {path} does not exist")
    if not is_complete(path):
        raise CheckpointError(f"resume: {path} is not a complete checkpoint (no {MARKER} marker or {META}); "
                              "it was probably interrupted while saving")
    return path


# The only non-tensor classes DeepSpeed 0.19 pickles into its shards (found with
# torch.serialization.get_unsafe_globals_in_checkpoint on ZeRO 0-3 checkpoints).
DEEPSPEED_SAFE_GLOBALS = [ZeroStageEnum, LossScaler, fragment_address]


def verify_weights_only(path: Path) -> None:
    """Load every shard of checkpoint ``path`` with ``torch.load(weights_only=True)`` first.

    DeepSpeed's own loader uses ``weights_only=False`` (hard-coded in 0.19), so a tampered
    shard could run code; this gate refuses any shard that holds more than tensors, plain
    data and DeepSpeed's three known classes, before DeepSpeed unpickles it. It costs one
    extra read of the checkpoint.
    """
    with torch.serialization.safe_globals(DEEPSPEED_SAFE_GLOBALS):
        for shard in sorted(Path(path).glob("*.pt")):
            try:
                torch.load(shard, map_location="cpu", weights_only=True)
            except Exception as e:
                raise CheckpointError(f"{shard} does not load with weights_only=True (unexpected pickled "
                                      f"objects?): {str(e).splitlines()[0]}") from e


def read_meta(path: Path) -> dict[str, Any]:
    """The side metadata of a checkpoint (plain JSON, readable without DeepSpeed or pickle)."""
    try:
        return json.loads((Path(path) / META).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"resume: cannot read {Path(path) / META}: {e}") from e


def check_compatible(meta: dict[str, Any], identity: dict[str, Any], path: Path) -> None:
    """Raise ``CheckpointError`` naming every config key whose value differs from the checkpoint's."""
    saved = _flatten(meta.get("identity", {}))
    ours = _flatten(identity)
    diffs = [f"{key}: checkpoint {saved.get(key)!r} vs config {ours.get(key)!r}"
             for key in sorted(set(saved) | set(ours)) if saved.get(key) != ours.get(key)]
    if diffs:
        raise CheckpointError(f"checkpoint {path} was written by an incompatible config (model dimensions or "
                              "tensorization differ):\n  " + "\n  ".join(diffs))


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out
