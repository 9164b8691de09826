"""A run's checkpoints as files: tags, completeness, ``resume auto``'s candidates, the side metadata, and the
config identity a checkpoint must share with the run loading it.

Nothing here imports torch or DeepSpeed: ``comera pretrain --check-config`` reads a run's checkpoints on a
login node with it (``resume_candidate``, ``check_compatible``; ``config._resume_target``), and checks one
checkpoint's files against its manifest (``check``). Writing, choosing (collectively verified) and loading
checkpoints is ``engine.checkpoint``'s, which re-exports all of this.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

from comera_dist.configbase import to_dict
from comera_dist.engine import manifest
from comera_dist.engine.manifest import MARKER

log = logging.getLogger("comera_dist.engine.checkpoint")  # one logger for every checkpoint message

META = "comera_meta.json"
CONFIG = "config.yaml"
FULL_STATE = "comera_full_state.pt"
PARAM_LAYOUT = 3
"""The parameter layout a checkpoint's meta records (``param_layout``; absent means 1). 1: one gate
``Parameter`` per bond (``<layer>.gates.<k>``) and one per core (``<layer>.cores.<k>``); 2: one gate
vector per layer (``<layer>.gate``); 3: also one flat core parameter per layer (``<layer>.core``).
DeepSpeed's own shards only load into the layout that wrote them; ``elastic.upgrade_layout``
converts the consolidated state."""
LATEST = "latest"
TMP_PREFIX = ".tmp-"
_TAG = re.compile(r"^step(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or incompatible with this run; the message says which and why."""


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def step_of(path: Path) -> int:
    return int(_TAG.match(Path(path).name).group(1))


def _replaced(root: Path, tag: str) -> Path:
    """Where a re-save keeps the copy of ``tag`` it replaces until the new one verified."""
    return root / f"{TMP_PREFIX}replaced-{tag}"


def is_complete(path: Path) -> bool:
    return (Path(path) / MARKER).is_file() and (Path(path) / META).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _TAG.match(p.name) and is_complete(p)]
    return sorted(found, key=step_of)


def latest_complete(root: Path, *, finish: bool = True) -> Path | None:
    """The checkpoint ``latest`` names if it is complete, else the newest complete one, else None.

    ``finish=False`` only reads: a reader outside the job (``comera evaluate`` on a live run) must not
    publish a half-renamed re-save, which would race the job's own rename and crash its save."""
    done = candidates_auto(root, finish=finish)
    return done[0] if done else None


def interrupted(root: Path) -> Path | None:
    """The directory ``finish_interrupted`` would publish under ``root`` (``.tmp-<tag>`` or
    ``.tmp-replaced-<tag>`` of the tag ``latest`` names), found without renaming it; None when there is none."""
    pointer = root / LATEST
    tag = pointer.read_text().strip() if pointer.is_file() else ""
    if not _TAG.match(tag) or (root / tag).exists():
        return None
    pending = root / (TMP_PREFIX + tag)
    if (pending / MARKER).is_file():
        return pending
    replaced = _replaced(root, tag)
    return replaced if is_complete(replaced) else None


def finish_interrupted(root: Path) -> Path | None:
    """Publish the checkpoint a crash left between two renames of a re-saved step: ``latest`` names a tag with
    no directory while ``.tmp-<tag>`` holds its manifest marker (written once every file was on disk and
    described), or else ``.tmp-replaced-<tag>`` holds the complete copy the re-save replaced (a crash while
    ``save`` put it back after a failed read-back). Returns the published directory, None when there is
    nothing to finish.

    Safe on every rank at once: the rename is atomic, and a rank that loses the race finds the directory in
    place. The files are verified like any other candidate's before a resume reads them."""
    pending = interrupted(root)
    if pending is None:
        return None
    final = root / pending.name.removeprefix(f"{TMP_PREFIX}replaced-").removeprefix(TMP_PREFIX)
    try:
        os.rename(pending, final)
    except OSError as e:  # another rank published it first, or the directory is read-only
        if not is_complete(final):
            log.warning("checkpoint %s: a crash interrupted its publication, and %s could not be published: %s",
                        final, pending.name, e)
            return None
    log.warning("checkpoint %s: a crash interrupted its publication after every file was written; published it "
                "from %s", final, pending.name)
    return final


def candidates_auto(root: Path, *, finish: bool = True) -> list[Path]:
    """Complete checkpoints under ``root`` to try, newest first (the one ``latest`` names leads, followed by
    the copy of it a re-save replaced, if a crash left one); first publishes one that a crash left
    half-renamed (``finish_interrupted``), unless ``finish=False``."""
    root = Path(root)
    if finish:
        finish_interrupted(root)
    done = complete_checkpoints(root)[::-1]
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if named in done:
            done.remove(named)
            replaced = _replaced(root, named.name)
            done[:0] = [named, replaced] if is_complete(replaced) else [named]
    return done


def requeued_spec(spec: str, root: Path, restarts: int, job_id: str | None) -> str:
    """The resume spec of Slurm job ``job_id`` requeued ``restarts`` times (``SLURM_RESTART_COUNT``): ``auto``
    once this job has written a checkpoint under ``root`` (the one ``auto`` takes first records the job's id in
    its meta, ``slurm_job_id``), whatever ``--resume`` the job was submitted with. A requeue runs the same
    command, so ``none`` would start over and a checkpoint path would go back to it at every requeue, and the
    job would never get past its time limit. Until the job's first checkpoint the spec stands: an older run's
    checkpoints in the same directory are what ``none`` or a rewind to an earlier step chose to leave."""
    if restarts < 1 or spec == "auto" or not job_id:
        return spec
    candidates = candidates_auto(root, finish=False)
    try:
        ours = bool(candidates) and read_meta(candidates[0]).get("slurm_job_id") == job_id
    except CheckpointError:
        ours = False  # unreadable: ``auto`` would skip it too; the spec stands
    return "auto" if ours else spec


def _given_root(path: Path, *, finish: bool = True) -> Path | None:
    """The checkpoints root a resume path names, when it is not one checkpoint: a checkpoints root, or the run
    directory above one (``train.output_dir``, which ``comera evaluate`` and ``export`` take too); else None.
    ``finish=False`` only reads (``candidates_auto``)."""
    if not path.is_dir() or is_complete(path):
        return None
    return next((root for root in (path, path / "checkpoints")
                 if candidates_auto(root, finish=finish) or interrupted(root)), None)


def resolve(spec: str, root: Path, *, finish: bool = True) -> Path | None:
    """Rank-local, unverified lookup (no collective): ``none`` -> None; ``auto`` -> the latest complete
    checkpoint under ``root`` (or None); else that path, which must be complete. ``choose`` verifies.
    ``finish=False`` only reads (``latest_complete``)."""
    if spec == "none":
        return None
    if spec == "auto":
        return latest_complete(root, finish=finish)
    path = Path(spec)
    given = _given_root(path, finish=finish)
    if given is not None:
        return latest_complete(given, finish=finish)
    if not path.is_dir():
        raise CheckpointError(f"resume: checkpoint directory {path} " + _not_a_directory(path))
    if not is_complete(path):
        raise CheckpointError(f"resume: {path} is not a complete checkpoint (no {MARKER} marker or {META}); "
                              "it was probably interrupted while saving")
    return path


def _not_a_directory(path: Path) -> str:
    """Why ``path`` is no checkpoint directory: it does not exist, or it is a file (a shard, its marker)."""
    if path.exists():
        return "is a file, not a directory: give the checkpoint's directory, or the run directory above it"
    return "does not exist"


def resume_candidate(spec: str, root: Path) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint a resume with ``spec`` tries first and its meta, found by reading only (no collective, no
    DeepSpeed, nothing published): for ``auto`` or a run directory the newest complete one whose files have their
    manifest's sizes and whose meta reads, else the path itself, which must have them (``CheckpointError``). None:
    a fresh start. The run's ``checkpoint.choose`` also digests every file and walks back past one that fails, so
    it may take an older checkpoint than this."""
    if spec == "none":
        return None
    path = Path(spec)
    given = root if spec == "auto" else _given_root(path, finish=False)
    if given is None:
        found = resolve(spec, root, finish=False)  # one checkpoint: it must be complete and its meta read
        problems = check(found, read=False)
        if problems:  # the run refuses it (checkpoint.choose): a truncated shard is one stat away
            raise CheckpointError(f"resume: checkpoint {found} fails verification: " + "; ".join(problems))
        return found, read_meta(found)
    pending = interrupted(given)  # the run publishes it first (finish_interrupted); a check only reads
    for candidate in ([pending] if pending else []) + candidates_auto(given, finish=False):
        if check(candidate, read=False):
            continue  # the run walks back past it too (its digests it reads; sizes cost a stat)
        try:
            return candidate, read_meta(candidate)
        except CheckpointError:
            continue  # the run skips it too: its meta is in its manifest, which cannot match
    return None


def check(path: Path, share: tuple[int, int] | None = None, *, names: tuple[str, ...] | None = None,
          read: bool = True) -> list[str]:
    """Problems of checkpoint ``path`` on this rank: its marker, then every file of its manifest.

    [] for a good checkpoint; a pre-manifest checkpoint passes with a warning (it cannot be verified).
    ``share=(rank, world)``: every file is checked for presence and size (what this rank sees of it), and only
    this rank's share of them is read and digested. The ranks' verdicts all-gathered (``checkpoint._agree``) cover
    every digest once: a resume reads the checkpoint once, not once per rank (W times a 512-rank job's shards).
    ``names``: only those files (the ones the manifest lists); ``read=False``: presence and sizes only, no digest
    (a login node's check of a large checkpoint: one stat per file).
    """
    path = Path(path)
    if not (path / MARKER).is_file():
        return [f"{path / MARKER}: missing (the save was interrupted before publication)"]
    try:
        found = manifest.read(path)
    except (OSError, ValueError) as e:
        return [str(e)]
    if found == manifest.LEGACY:
        log.warning("checkpoint %s was written before checkpoint manifests: its files cannot be verified", path)
        return [] if (path / META).is_file() else [f"{path / META}: missing"]
    listed = None if names is None else [n for n in names if n in found["files"]]
    if not read:
        return manifest.verify(path, found, listed, digests=[])
    if share is None:
        return manifest.verify(path, found, listed)
    rank, world = share
    return manifest.verify(path, found, listed, digests=sorted(found["files"])[rank::world])


def read_meta(path: Path) -> dict[str, Any]:
    """The side metadata of a checkpoint (plain JSON, readable without DeepSpeed or pickle)."""
    try:
        return json.loads((Path(path) / META).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"resume: cannot read {Path(path) / META}: {e}") from e


def check_compatible(meta: dict[str, Any], identity: dict[str, Any], path: Path, *, one_line: bool = False) -> None:
    """Raise ``CheckpointError`` naming every config key whose value differs from the checkpoint's, and the two
    ways on (its own config, or another output directory for this one); ``one_line`` for a command's one-line
    error (``--check-config``), else a line per key (the run's log)."""
    saved = _flatten(meta.get("identity", {}))
    ours = _flatten(identity)
    diffs = [f"{key}: checkpoint {saved.get(key)!r} vs config {ours.get(key)!r}"
             for key in sorted(set(saved) | set(ours)) if saved.get(key) != ours.get(key)]
    if diffs:
        head, sep, tail = (": ", "; ", "; ") if one_line else (":\n  ", "\n  ", "\n")
        raise CheckpointError(f"checkpoint {path} was written by an incompatible config (model dimensions or "
                              f"tensorization differ){head}" + sep.join(diffs) + f"{tail}resume it with the config "
                              f"that wrote it ({Path(path) / CONFIG}), or train this config in another "
                              "train.output_dir")


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


SHAPE_KEYS = ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
              "max_positions", "type_vocab_size", "num_labels", "tie_word_embeddings")
"""The model config keys that fix parameter shapes: a checkpoint's must equal the resuming run's."""


def identity(cfg) -> dict[str, Any]:
    """The config values a checkpoint must share with the run loading it."""
    model = to_dict(cfg.model)
    tensorize = to_dict(cfg.comera.tensorize)
    # Only what fixes parameter shapes: dropout, init scales etc. may change on resume.
    return {"model": {k: model[k] for k in SHAPE_KEYS if k in model},
            "tensorize": {k: v for k, v in tensorize.items() if k != "init"},
            "comera_enabled": cfg.comera.enabled}
