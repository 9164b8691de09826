"""Sharded DeepSpeed checkpoints: atomic publication, a verified manifest, safe retention, ``resume auto``.

Layout under ``<output_dir>/checkpoints``::

    step00000012/            one published checkpoint (DeepSpeed's per-rank files)
        comera_meta.json     shapes (pruning plans), config identity, step, world size, ZeRO stage,
                             parameter layout, the roles packed into flat parameters (engine.packing),
                             the Slurm job and the run tokenizer's digest (engine.checkpoint_layout reads it)
        comera_full_state.pt full fp32 weights + AdamW moments + schedule (elastic resume, see session)
        config.yaml          the resolved run config
        metrics_history.json rank 0's metrics history as of this step (the trainer's side file; the report)
        COMPLETE             the manifest (every file, size, xxh3-128 digest), written last: the checkpoint is whole
    latest                   the tag of the newest complete, verified checkpoint (DeepSpeed's format)

All ranks call ``engine.save_checkpoint`` under a temporary tag ``.tmp-<tag>``; rank 0 adds the side
files, each rank fsyncs the files it wrote; after a barrier the ranks hash (and fsync) a share of the
files each, rank 0 fsyncs the directory, writes the manifest and renames the directory to its final tag; then the
ranks re-verify the published files against the manifest, and only a verified checkpoint moves
``latest`` and lets retention delete older ones. A crash at any point leaves ``latest`` on the
previous complete checkpoint; leftovers of temporary tags are ignored by ``resume auto`` and
removed by the next save.

Re-saving the step ``latest`` names (a job stopped right after its resume) moves the old copy aside
to ``.tmp-replaced-<tag>`` and renames the new one in; the old copy is deleted only once the new one
verified. If the read-back fails, the new copy goes to ``.tmp-failed-<tag>`` and the old one comes
back, so ``latest`` still names a good checkpoint. A crash between two of these renames leaves
``latest`` naming no directory: ``resume auto`` publishes the complete ``.tmp-<tag>`` (the new copy)
or else ``.tmp-replaced-<tag>`` (``finish_interrupted``). A crash after the failed read-back, before
the failed copy moved aside, leaves it in place beside the old copy: ``resume auto`` tries the old copy
right after it and puts it back (``choose``).

Resume (``choose``): before anything unpickles a byte, every rank checks that each file of the manifest is
there with its size, and digests its share of them (``check(path, share)``); the verdicts are all-gathered so
the ranks agree and every digest is read once. Each rank once digested every file: W reads of the whole
checkpoint, hours for a large ZeRO-3 job on a shared file system. With node-local copies (each node its own),
a copy damaged on one node alone is caught only where that node's rank digests it. ``auto`` walks back from
the newest checkpoint to the first that verifies, logging each one it skips and why; an explicit path that
fails is an error naming the file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import deepspeed.comm as dist
import torch
import yaml
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from comera_dist.engine import manifest

# the files' layout, re-exported: callers use ckpt.<name> for both
from comera_dist.engine.checkpoint_layout import (  # noqa: F401
    _TAG,
    CONFIG,
    FULL_STATE,
    LATEST,
    META,
    PARAM_LAYOUT,
    TMP_PREFIX,
    CheckpointError,
    _given_root,
    _not_a_directory,
    _replaced,
    candidates_auto,
    check,
    check_compatible,
    complete_checkpoints,
    finish_interrupted,
    identity,
    is_complete,
    latest_complete,
    read_meta,
    requeued_spec,
    resolve,
    resume_candidate,
    step_of,
    tag_for,
)
from comera_dist.engine.manifest import MARKER

log = logging.getLogger(__name__)


def _write_atomic(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all, durably: the file, then its directory entry (fsync)."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_PER_RANK = re.compile(r"(?:^|_)zero_pp_rank_(\d+)_")
"""DeepSpeed's per-rank shard names (``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``, a ``bf16_`` prefix under
bf16, ``..._model_states.pt`` at ZeRO 3)."""


def written_by(names: list[str], rank: int) -> list[str]:
    """The files of a checkpoint that ``rank`` wrote: DeepSpeed's shards named for it, and on rank 0 every file
    not named for a rank (the model states at ZeRO 0-2, the meta, config, consolidated state, side files)."""
    def owner(name: str) -> int:
        found = _PER_RANK.search(Path(name).name)
        return int(found.group(1)) if found else 0

    return [n for n in names if owner(n) == rank]


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _agree(problems: list[str]) -> list[str]:
    """Every rank's problems, all-gathered (collective): the same sorted verdict on every rank."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problems)
    return sorted({p for ps in everyone for p in ps})


def _my_share(names: list[str]) -> list[str]:
    rank, world = _share()
    return names[rank::world]


def _share() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _failed(root: Path, tag: str) -> Path:
    """Where a re-save moves its new copy of ``tag`` when the read-back fails (swept by the next save)."""
    return root / f"{TMP_PREFIX}failed-{tag}"


def _put_back(root: Path, tag: str) -> None:
    """The copy of ``tag`` a re-save replaced back in place; the copy there (if any) moves to ``_failed``.

    Each rename is atomic, and a crash between them leaves ``latest`` naming no directory beside a
    complete ``_replaced`` copy, which ``finish_interrupted`` publishes."""
    final, failed = root / tag, _failed(root, tag)
    if final.exists():
        shutil.rmtree(failed, ignore_errors=True)
        os.rename(final, failed)
    os.rename(_replaced(root, tag), final)
    _fsync_dir(root)


def save(engine, root: Path, step: int, *, client_state: dict[str, Any], meta: dict[str, Any],
         resolved_config: dict[str, Any], keep: int, keep_every: int = 0, full_state: dict[str, Any] | None = None,
         retain: bool = True, side_files: Mapping[str, str] | None = None, before_publish=None) -> Path:
    """Save a checkpoint of ``engine`` at ``step`` (collective), publish and verify it; returns its dir.

    ``full_state`` (plain tensors/data, rank 0's copy is written) is the consolidated state that
    elastic resume loads. ``side_files`` (rank 0's): ``{name: text}`` written beside the meta, so the
    manifest vouches for them with the rest (e.g. the metrics history as of this step).
    ``retain=False`` publishes without deleting any older checkpoint.
    ``before_publish`` (tests): called on rank 0 after every file is written, before the manifest.
    Raises ``CheckpointError`` if the published files do not match their manifest (``latest`` and
    older checkpoints are then left as they were; a re-saved step's old copy is back in place).
    """
    clash = sorted(set(side_files or ()) & {META, CONFIG, FULL_STATE, MARKER})
    if clash:
        raise ValueError(f"checkpoint.save: side_files may not replace the checkpoint's own {clash}")
    root = Path(root)
    tag = tag_for(step)
    tmp_dir, final = root / (TMP_PREFIX + tag), root / tag
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        # What a crashed earlier attempt left (``resume auto`` already published or put back what it could).
        for stale in (tmp_dir, _replaced(root, tag)):
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    engine.save_checkpoint(str(root), tag=tmp_dir.name, client_state=client_state, save_latest=False)
    if rank == 0:
        (tmp_dir / META).write_text(json.dumps({**meta, "step": step, "tag": tag}, indent=2))
        (tmp_dir / CONFIG).write_text(yaml.safe_dump(resolved_config, sort_keys=False))
        if full_state is not None:
            torch.save(full_state, tmp_dir / FULL_STATE)
        for name, text in (side_files or {}).items():
            (tmp_dir / name).write_text(text)
    # Each rank flushes what it wrote itself: on a file system shared across nodes, the rank that hashes (and
    # fsyncs) a file below may be on another node, whose fsync need not flush the writer's cached pages.
    for name in written_by(manifest.checkpoint_files(tmp_dir), rank):
        _fsync_file(tmp_dir / name)
    dist.barrier()  # every rank's shards and the side files are on disk
    names = manifest.checkpoint_files(tmp_dir)  # the same list on every rank (shared file system)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, manifest.describe(tmp_dir, _my_share(names), sync=True))  # each file fsynced
    replaced = _replaced(root, tag)
    if rank == 0:
        if before_publish is not None:
            before_publish(tmp_dir)
        files = {k: v for part in parts for k, v in part.items()}
        for folder in sorted({(tmp_dir / n).parent for n in names} | {tmp_dir}):
            _fsync_dir(folder)  # the files' names too, before the manifest vouches for them
        _write_atomic(tmp_dir / MARKER, manifest.render(tag, files))
        if final.exists():  # re-saving a step (e.g. after a resume): keep the old copy until the new verified
            os.rename(final, replaced)
        os.rename(tmp_dir, final)
        _fsync_dir(root)
    dist.barrier()
    resaved = replaced.is_dir()  # rank 0 moved an old copy aside (shared file system, as for `names`)
    # Read the published files back against the manifest before anything older may go.
    problems = _agree(manifest.verify(final, manifest.read(final), _my_share(names)))
    if problems:
        if rank == 0 and resaved:
            _put_back(root, tag)
        dist.barrier()  # no rank raises before the old copy is back
        kept = (f"the copy it replaced is back in place (`latest` names it), the failed one is in "
                f"{_failed(root, tag).name}; older checkpoints are kept" if resaved
                else "`latest` and older checkpoints are kept")
        raise CheckpointError(f"checkpoint {final} does not match its manifest after saving; {kept}:\n  "
                              + "\n  ".join(problems))
    if rank == 0:
        _write_atomic(root / LATEST, tag)
        shutil.rmtree(replaced, ignore_errors=True)
        if retain:
            remove_old(root, keep, keep_every)
    dist.barrier()
    return final


def remove_old(root: Path, keep: int, keep_every: int = 0) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep``, sparing every ``keep_every``-th step
    and whatever ``latest`` names; remove leftover temporary tags. Returns what was deleted.

    Called only after the newest checkpoint was published and verified.
    """
    root = Path(root)
    pointer = root / LATEST
    protected = {pointer.read_text().strip()} if pointer.is_file() else set()
    removed = []
    for path in complete_checkpoints(root)[:-keep]:
        if path.name in protected or (keep_every > 0 and step_of(path) % keep_every == 0):
            continue
        # out of sight first, in one rename: a reader (``comera evaluate`` on the live run) finds it gone at once,
        # and what a failed delete leaves is a temporary tag, which the sweep below retries next time
        doomed = root / f"{TMP_PREFIX}removing-{path.name}"
        try:
            if doomed.exists():  # a failed delete of an earlier checkpoint of that step, since saved again
                shutil.rmtree(doomed)
            os.rename(path, doomed)
        except OSError as e:  # after publication: housekeeping, never a failed save (nor ranks left at a barrier)
            log.warning("retention: could not remove %s (%s); it is kept, and tried again at the next checkpoint",
                        path, e)
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    for path in root.glob(TMP_PREFIX + "*"):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
    return removed


def choose(spec: str, root: Path) -> Path | None:
    """The checkpoint to resume from, verified on every rank (collective); None for a fresh start.

    ``none`` -> None. ``auto`` -> the newest checkpoint under ``root`` that verifies on every rank
    (each skipped one is logged with its reasons); None when there is none at all, an error when
    there are some but none verifies. A path -> that checkpoint (or, for a
    checkpoints root or the run directory above one, ``auto`` inside it); a path that fails verification
    raises ``CheckpointError`` naming the file.
    """
    if spec == "none":
        return None
    path = Path(spec)
    given = _given_root(path) if spec != "auto" else None
    if given is not None:
        spec, root = "auto", given
    if spec == "auto":
        tried = candidates_auto(root)
        _log_incomplete(root)
        for candidate in tried:
            problems = _agree(check(candidate, _share()))
            if not problems:
                return candidate if _TAG.match(candidate.name) else _reinstate(candidate)
            if dist.get_rank() == 0:
                log.warning("resume auto: skipping checkpoint %s, it does not verify:\n  %s", candidate,
                            "\n  ".join(problems))
        if tried:  # starting over would silently discard the run: let the user decide
            raise CheckpointError(f"resume auto: none of the {len(tried)} checkpoints under {root} verifies (see "
                                  "the log for each); pass --resume none to start over or --resume PATH")
        return None
    if not path.is_dir():
        raise CheckpointError(f"resume: checkpoint directory {path} " + _not_a_directory(path))
    problems = _agree(check(path, _share()))
    if problems:
        raise CheckpointError(f"resume: checkpoint {path} fails verification:\n  " + "\n  ".join(problems))
    if not (path / META).is_file():
        raise CheckpointError(f"resume: {path} is not a complete checkpoint (no {META})")
    return path


def _log_incomplete(root: Path) -> None:
    """Name each checkpoint directory under ``root`` that ``auto`` passes over for lacking its markers, and a
    ``latest`` that names no complete checkpoint (rank 0)."""
    if not root.is_dir() or dist.get_rank() != 0:
        return
    pointer = root / LATEST
    named = pointer.read_text(errors="replace").strip() if pointer.is_file() else None
    if named is not None and not (_TAG.match(named) and is_complete(root / named)):
        log.warning("resume auto: %s names %r, not a complete checkpoint there; trying the newest complete ones",
                    pointer, named[:80])
    for path in sorted((p for p in root.iterdir() if p.is_dir() and _TAG.match(p.name) and not is_complete(p)),
                       key=step_of):
        missing = [name for name in (MARKER, META) if not (path / name).is_file()]
        log.warning("resume auto: skipping checkpoint %s, it is incomplete (no %s)", path, " or ".join(missing))


def _reinstate(replaced: Path) -> Path:
    """Put a verified copy a re-save replaced back in place of the one that failed (collective); its final path.

    A crash after a re-save's read-back failed, before ``save`` put the old copy back, leaves it here."""
    tag = replaced.name.removeprefix(f"{TMP_PREFIX}replaced-")
    if dist.get_rank() == 0:
        log.warning("resume auto: %s fails verification; putting back the copy a re-save replaced (%s)",
                    replaced.parent / tag, replaced.name)
        _put_back(replaced.parent, tag)
    dist.barrier()
    return replaced.parent / tag


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


def read_full_state(path: Path) -> dict[str, Any]:
    """The consolidated state of checkpoint ``path`` (``weights_only``); an error naming the file if absent."""
    file = Path(path) / FULL_STATE
    if not file.is_file():
        raise CheckpointError(f"{file} is missing: checkpoint {path} predates elastic resume and can only be "
                              "loaded with the world size and ZeRO stage that wrote it")
    return torch.load(file, map_location="cpu", weights_only=True)
