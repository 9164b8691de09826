"""Saving and resuming a ``TrainSession``: what its checkpoints hold beyond DeepSpeed's own shards.

``save`` adds to DeepSpeed's checkpoint the CoMERA state (step, controller, pruning plans, every
rank's RNG and loader position) and a consolidated full state for elastic resume, and refuses to
publish a non-finite state. ``resume`` verifies the checkpoint, rebuilds the model at its pruned
shapes, and loads it through DeepSpeed or, across world sizes, ZeRO stages, precisions and parameter
layouts, through the consolidated state (``engine/elastic.py``). ``TrainSession.save``/``resume`` call these.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import deepspeed.comm as dist
import numpy as np
import torch
import yaml

from comera_dist.compression.groups import role_settings
from comera_dist.compression.pruning import PruningPlan
from comera_dist.engine import checkpoint as ckpt
from comera_dist.engine import elastic
from comera_dist.engine.hooks import PenaltyHook
from comera_dist.engine.model_factory import set_thresholds
from comera_dist.engine.packing import packed_roles, packing_layout
from comera_dist.engine.prune import load_full_state, model_at_shapes, restore_optimizer_state

if TYPE_CHECKING:
    from comera_dist.engine.session import TrainSession

log = logging.getLogger(__name__)
OWN_META = frozenset({"identity", "plans", "world_size", "zero_stage", "precision", "param_layout", "packing",
                      "packing_layout", "slurm_job_id", "step", "tag"})
"""The keys ``save`` and ``checkpoint.save`` write into a checkpoint's meta, which ``meta_fields`` may not replace."""
def save(session: TrainSession, step: int, client_state: Mapping[str, Any] | None = None, *, retain: bool = True,
         side_files: Mapping[str, str] | None = None, meta_fields: Mapping[str, Any] | None = None,
         before_publish=None) -> Path | None:
    """Checkpoint at ``step`` on every rank (collective); each rank's ``client_state`` (plain data,
    e.g. its loader position) rides along and comes back to that rank on resume. ``side_files``: rank 0's
    extra files for the checkpoint's directory (``checkpoint.save``); ``meta_fields``: plain JSON fields for its
    meta, which readers take without unpickling anything (the run's tokenizer digest, checked by ``comera
    evaluate`` and ``export``); ``resume`` returns the directory.

    Returns None, writing nothing, when a parameter or optimizer moment is non-finite: such a
    state is never published as the last good one. ``retain=False`` deletes no older checkpoint.
    """
    from comera_dist.config import (
        resolved_dict,  # config imports engine.config; avoid the cycle at import
    )

    clash = sorted(set(meta_fields or ()) & OWN_META)
    if clash:  # before any collective: every rank raises alike
        raise ValueError(f"resume.save: meta_fields may not replace the checkpoint's own {clash}")

    rng = [None] * session.world_size
    dist.all_gather_object(rng, rng_state())
    comera_state = {"step": step, "steps_done": session.steps_done, "nonfinite_total": session.nonfinite_total,
                    "controller": session.controller.state_dict(), "plans": [pl.to_json() for pl in session.plans],
                    "rng": rng, "world_size": session.world_size}
    meta = {"identity": ckpt.identity(session.cfg), "plans": [pl.to_json() for pl in session.plans],
            "world_size": session.world_size, "zero_stage": session.cfg.deepspeed.zero_stage,
            "precision": session.cfg.deepspeed.precision, "param_layout": ckpt.PARAM_LAYOUT,
            "packing": packed_roles(session.module), "packing_layout": packing_layout(session.module),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID")}  # a requeue of this job continues it (requeued_spec)
    meta.update(meta_fields or {})
    # DeepSpeed writes client_state from data-parallel rank 0 only (ZeRO 0-2), so every rank's
    # own dict is gathered here and each rank gets its own back on resume.
    clients: list[Any] = [None] * session.world_size
    dist.all_gather_object(clients, dict(client_state or {}))
    client = {"comera": comera_state, "clients": clients}
    full, bad = elastic.consolidate(session.engine, client)  # collective; identical on every rank
    if bad:
        if dist.get_rank() == 0:
            log.error("step %d: not checkpointing: %d parameter/optimizer tensors are non-finite (%s); "
                      "the last good checkpoint stays %s", step, len(bad), ", ".join(bad[:5]),
                      ckpt.latest_complete(session.checkpoint_root))
        return None
    train = session.cfg.train
    return ckpt.save(session.engine, session.checkpoint_root, step, client_state=client, meta=meta,
                     resolved_config=resolved_dict(session.cfg), keep=train.keep_checkpoints,
                     keep_every=train.keep_every, full_state=full, retain=retain, side_files=side_files,
                     before_publish=before_publish)


def resume(session: TrainSession, spec: str) -> dict[str, Any] | None:
    """Load ``auto`` | ``none`` | a checkpoint path; returns the saved ``client_state`` with ``step`` and
    ``checkpoint_dir`` (the directory loaded) added (None: fresh start).

    Every rank verifies the checkpoint's files against its manifest first (``auto`` walks back to
    the newest one that verifies). A pruned checkpoint is loaded into a model rebuilt at its saved
    shapes. A checkpoint of another world size, ZeRO stage, precision (DeepSpeed names its optimizer
    shards by precision) or packing (``engine.packing``) is loaded from its consolidated state
    (``engine/elastic.py``), and so is one written before each layer's gates and cores became one
    parameter each (``param_layout`` 1 or 2), converted by ``elastic.upgrade_layout``. Collective.
    """
    path = ckpt.choose(spec, session.checkpoint_root)
    if path is None:
        return None
    meta = ckpt.read_meta(path)
    ckpt.check_compatible(meta, ckpt.identity(session.cfg), path)
    plans = [PruningPlan.from_json(text) for text in meta["plans"]]
    rank, stage, precision = dist.get_rank(), session.cfg.deepspeed.zero_stage, session.cfg.deepspeed.precision
    legacy = meta.get("param_layout", 1) < ckpt.PARAM_LAYOUT  # DeepSpeed's shards cannot load
    # DeepSpeed's shards hold flat parameters for the roles the writing engine packed (engine.packing)
    saved_packing, packing = _saved_packing(meta), (packed_roles(session.module), packing_layout(session.module))
    repacked = saved_packing != packing
    # Unrecorded (older checkpoints): assume ours; DeepSpeed's loader then names a missing shard (_load_shards).
    saved_precision = meta.get("precision", precision)
    if (legacy or repacked or saved_precision != precision or meta["world_size"] != session.world_size
            or meta.get("zero_stage", stage) != stage):
        if rank == 0:
            why = (f"parameter layout {meta.get('param_layout', 1)} -> {ckpt.PARAM_LAYOUT} (one core and one gate "
                   f"parameter per layer)" if legacy else elastic.describe_move(meta, session.world_size, stage))
            if saved_precision != precision:
                why += f", precision {saved_precision} -> {precision}"
            if repacked:
                why += (f", packed roles {saved_packing[0] or 'none'} (layout {saved_packing[1]}) -> "
                        f"{packing[0] or 'none'} (layout {packing[1]})")
            log.info("elastic resume from %s: %s", path, why)
        payload = ckpt.read_full_state(path)
        if legacy:
            payload = elastic.upgrade_layout(payload)
        state = elastic.full_state(payload, torch.device("cpu"))
        model = model_at_shapes(session.factory, plans)
        load_full_state(model, state)
        session._replace_engine(model)
        session.plans = plans
        restore_optimizer_state(session.engine, elastic.full_state(payload, session.device),
                                set_master=session.cfg.deepspeed.precision != "fp32")
        elastic.restore_schedule(session.engine, payload)
        scheduled = payload["scheduler"] is not None
        client = payload["client"]
    else:
        if plans != session.plans:
            session._replace_engine(model_at_shapes(session.factory, plans))
            session.plans = plans
        ckpt.verify_weights_only(path)
        scheduled = _saved_scheduler(path) != "constant"
        client = _load_shards(session, path, "precision" in meta, scheduled)
        sched = session.engine.lr_scheduler  # the lrs of the loaded position, whatever the groups held
        elastic.place_schedule(session.engine, sched.state_dict() if scheduled and sched is not None else None)
    if not scheduled and session.engine.lr_scheduler is not None and rank == 0:
        log.info("resume: %s was written without an LR scheduler; this run's %s starts at optimizer step %d, where "
                 "it would be had it run from the start", path, session.cfg.deepspeed.scheduler.kind,
                 session.engine.global_steps)
    state = client["comera"]
    session.controller.load_state_dict(state["controller"])
    _apply_run_settings(session)
    session.steps_done = state["steps_done"]
    session.nonfinite_total = state["nonfinite_total"]
    set_rng_state(elastic.rank_entry(state["rng"], rank))
    return dict(elastic.rank_entry(client["clients"], rank), step=state["step"], checkpoint_dir=path)


def _apply_run_settings(session: TrainSession) -> None:
    """What this run's config decides, over what the load restored: every TT layer's gate threshold
    (``comera.controller.tau``, ``embedding_tau``: a state-dict buffer, so the load brought back the writing run's),
    each param group's weight decay and, without an LR scheduler, its lr (``comera.lr``: DeepSpeed's load restores
    the writing run's groups; a scheduler re-sets the lrs from this run's config at the loaded position, and an
    elastic resume builds its groups from it), and the late stage's S* from the config's ``target_ratio``
    (``RankController.retarget``; call it after the controller's state is loaded). Changing these on resume is how
    a run recovers from a collapse, as its message says; what changed is logged once (rank 0). Every rank does the
    same."""
    cfg = session.cfg.comera
    taus: dict[tuple[float, float], list[str]] = {}
    for name, move in set_thresholds(session.module, cfg.controller).items():
        taus.setdefault(move, []).append(name)
    if taus:
        session.penalty = PenaltyHook(session.module)  # it keeps each layer's tau
    changed = [f"tau {old:g} -> {new:g} ({names[0] if len(names) == 1 else f'{len(names)} layers'})"
               for (old, new), names in taus.items()]
    keys = ("lr", "weight_decay") if session.engine.lr_scheduler is None else ("weight_decay",)
    settings = role_settings(cfg.lr)
    for group in session.engine.optimizer.param_groups:
        for key, value in zip(("lr", "weight_decay"), settings.get(group.get("name"), ())):
            if key in keys and group[key] != value:
                changed.append(f"{group['name']} {key} {group[key]:g} -> {value:g}")
                group[key] = value
    moved = session.controller.retarget()
    if moved:
        changed.append(f"late-stage target size S* {moved[0]:g} -> {moved[1]:g} (target_ratio "
                       f"{cfg.controller.target_ratio:g})")
    if changed and dist.get_rank() == 0:
        log.info("resume: this run's config changes the checkpoint's %s", ", ".join(changed))
    kept = session.controller.stage_kept()
    if kept and dist.get_rank() == 0:
        log.warning("resume: %s", kept)


def _saved_scheduler(path: Path) -> str | None:
    """The ``deepspeed.scheduler.kind`` of the run that wrote checkpoint ``path`` (its resolved config; None when
    unrecorded). A checkpoint written without a scheduler holds no scheduler state, on which DeepSpeed's load of a
    scheduled run failed with a ``TypeError``."""
    try:
        saved = yaml.safe_load((path / ckpt.CONFIG).read_text())
    except (OSError, yaml.YAMLError):
        return None
    kind = saved.get("deepspeed", {}).get("scheduler", {}).get("kind") if isinstance(saved, dict) else None
    return kind if isinstance(kind, str) else None


def _load_shards(session: TrainSession, path: Path, precision_known: bool, scheduled: bool) -> dict[str, Any]:
    """DeepSpeed's ``load_checkpoint`` of ``path`` into the session's engine (returns the client state; the LR
    scheduler's state only when the writing run had one, ``scheduled``); a
    ``CheckpointError`` naming the file when it cannot. A missing shard of a checkpoint that predates the
    recorded ``precision`` most likely means the other precision wrote it (DeepSpeed names the optimizer
    shards ``bf16_zero_pp_rank_*`` under bf16 and ``zero_pp_rank_*`` under fp32): the error says so and
    what to do."""
    try:
        loaded, client = session.engine.load_checkpoint(str(path.parent), tag=path.name,
                                                        load_lr_scheduler_states=scheduled)
    except FileNotFoundError as e:
        precision = session.cfg.deepspeed.precision
        why = ("" if precision_known else
               f"; the checkpoint predates recording its precision, so it was probably written at another "
               f"deepspeed.precision than this run's {precision!r}: resume with deepspeed.precision set to the one "
               "that wrote it")
        raise ckpt.CheckpointError(f"resume: {e.filename} is missing, DeepSpeed cannot load checkpoint {path}"
                                   f"{why}") from e
    if loaded is None:
        raise ckpt.CheckpointError(f"DeepSpeed could not load checkpoint {path}")
    return client


def rng_state() -> dict[str, Any]:
    """torch, python, numpy and (when present) every CUDA device's RNG states as plain lists/ints
    (picklable without torch storages)."""
    np_state = np.random.get_state()
    state = {"torch": torch.get_rng_state().tolist(), "python": random.getstate(),
             "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    if torch.cuda.is_available():  # dropout on CUDA draws from the device generators
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what ``rng_state`` captured; CUDA states only when both the checkpoint and this host have them
    (a CPU checkpoint resumed on GPUs, or the reverse, keeps this process's seeded CUDA generators)."""
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    random.setstate(_as_tuple(state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        n = min(len(cuda), torch.cuda.device_count())
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in cuda[:n]])


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def _saved_packing(meta: Mapping[str, Any]) -> tuple[list[str], int]:
    """The roles a checkpoint's engine packed and its ``packing.LAYOUT`` (0: nothing packed): its meta's
    ``packing`` and ``packing_layout``; a checkpoint of the first packing (the dense vectors only) says
    ``packed_vectors: true``; older ones packed nothing; before ``packing_layout`` the layout was 1."""
    if "packing" in meta:
        roles = sorted(meta["packing"])
    else:
        roles = ["dense"] if meta.get("packed_vectors") else []
    return roles, int(meta.get("packing_layout", 1)) if roles else 0
