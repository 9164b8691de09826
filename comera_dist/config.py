"""The run config: one YAML file with the model, comera, data, train, deepspeed and metrics sections.

``load_run_config`` reads the file, applies ``--set a.b=value`` overrides, builds every
section's own dataclass (unknown keys, wrong types and bad values are ``ConfigError``s naming
the dotted key), then checks what no single section can: sequence length vs positions,
tensorization modes vs model dimensions, and (given the world size) the batch arithmetic.
All of it runs before any process group starts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from comera_dist.compression.config import ComeraConfig
from comera_dist.configbase import ConfigError, from_dict, load_yaml, nearest_existing, to_dict
from comera_dist.data.config import DataConfig
from comera_dist.engine.config import DeepSpeedSection, TrainConfig, solve_batch_sizes
from comera_dist.metrics.config import MetricsConfig
from comera_dist.models.config import ModelConfig
from comera_dist.tensor.factorize import factorize


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """Everything one training run needs; each section belongs to the package it configures."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture and sizes (``comera_dist.models``)."""
    comera: ComeraConfig = field(default_factory=ComeraConfig)
    """Tensorization, rank controller, pruning, per-role lrs (``comera_dist.compression``)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Corpus, tokenizer, packing (``comera_dist.data``)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Steps, evaluation, checkpoints, resume (``comera_dist.engine``)."""
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    """ZeRO stage, precision, batch sizes, optimizer and schedule (generates the DeepSpeed JSON)."""
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    """Console, Prometheus and report outputs (``comera_dist.metrics``)."""


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to nested ``data`` in place."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like section.key=value")
        try:
            node = yaml.compose(raw, Loader=yaml.SafeLoader)
            value = yaml.safe_load(raw)
        except yaml.YAMLError as e:
            raise ConfigError(f"override {key}: cannot parse value {raw!r}: {e}") from e
        if node is not None and raw[node.end_mark.index:].strip():  # " #..." is a YAML comment: it was dropped
            raise ConfigError(f"override {key}: YAML reads {raw!r} as {value!r}, the rest being a comment; quote "
                              f"the value to keep it whole (--set '{key.strip()}=\"{raw}\"')")
        parts = key.strip().split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key}: {'.'.join(parts[:i + 1])} is not a section "
                                  f"(it holds {child!r})")
            node = child
        node[parts[-1]] = value
    return data


def build_run_config(data: dict[str, Any]) -> RunConfig:
    """``RunConfig`` from plain data, with the cross-section checks (not the world-size one)."""
    cfg = from_dict(RunConfig, data, "")
    check_cross_sections(cfg)
    return cfg


def load_run_config(path: str | Path, overrides: Sequence[str] = (), *, world_size: int | None = None) -> RunConfig:
    """Read ``path``, apply ``overrides``, validate; with ``world_size`` also the batch arithmetic."""
    data = apply_overrides(load_yaml(path), overrides)
    try:
        cfg = build_run_config(data)
    except ConfigError as e:  # the file and the overrides: either may hold the bad key
        raise ConfigError(f"{path}{' with --set ' + ' '.join(overrides) if overrides else ''}: {e}") from e
    if world_size is not None:
        check_world_size(cfg, world_size)
    return cfg


def check_world_size(cfg: RunConfig, world_size: int) -> None:
    """``micro x accumulation x world == global``, and a validation pass of at least one block per rank, as a
    ``ConfigError`` naming the keys."""
    try:
        sizes = solve_batch_sizes(cfg.deepspeed, world_size)
    except ValueError as e:
        raise ConfigError(f"{e} (world size {world_size})") from e
    blocks = cfg.train.eval_batches * sizes.micro_batch
    if blocks < world_size:  # each rank's shard of the shared pass would be empty
        raise ConfigError(f"train.eval_batches={cfg.train.eval_batches} x micro_batch_size_per_gpu={sizes.micro_batch} = "
                          f"{blocks} validation blocks, fewer than the world size {world_size}: the pass is shared "
                          f"among the ranks, so set train.eval_batches >= {math.ceil(world_size / sizes.micro_batch)}")


def check_cross_sections(cfg: RunConfig) -> None:
    """Checks spanning sections: sequence length, ``train.compile`` vs the ZeRO stage, an embedding threshold
    without a TT embedding, the metrics' scrape waits vs the process-group timeout, a prune floor that prunes
    nothing, and the tensorization vs the model dimensions."""
    if cfg.data.seq_len > cfg.model.max_positions:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len} exceeds model.max_positions="
                          f"{cfg.model.max_positions}")
    if cfg.train.compile and cfg.deepspeed.zero_stage == 3:
        # tried (torch 2.13, DeepSpeed 0.19.8): hundreds of graph breaks, then InternalTorchDynamoError
        # (NameError '___tuple_iterator_getitem') at the first forward
        raise ConfigError("train.compile=true needs deepspeed.zero_stage 0, 1 or 2 (got 3): ZeRO-3 gathers each "
                          "module's parameters in forward hooks, which break the compiled graph at every module, "
                          "and torch.compile fails on them at the first forward")
    if cfg.train.compile_optimizer and not (cfg.train.compile and cfg.deepspeed.zero_stage in (1, 2)):
        raise ConfigError(f"train.compile_optimizer=true needs train.compile=true and deepspeed.zero_stage 1 or 2 "
                          f"(got train.compile={str(cfg.train.compile).lower()}, deepspeed.zero_stage="
                          f"{cfg.deepspeed.zero_stage}): it compiles DeepSpeed's ZeRO 1-2 optimizer step")
    if cfg.comera.controller.embedding_tau is not None and not (cfg.comera.enabled and cfg.comera.tensorize.embedding):
        raise ConfigError(f"comera.controller.embedding_tau={cfg.comera.controller.embedding_tau} would change "
                          f"nothing: the model has no TT embedding (comera.enabled="
                          f"{str(cfg.comera.enabled).lower()}, comera.tensorize.embedding="
                          f"{str(cfg.comera.tensorize.embedding).lower()})")
    for key in ("first_scrape_timeout_s", "final_scrape_timeout_s"):
        wait = getattr(cfg.metrics, key)
        if cfg.metrics.prometheus and wait >= cfg.train.process_group_timeout_s:
            # while rank 0 waits for the scrape, the other ranks wait in a collective (the first step's, the
            # closing barrier), which the process-group timeout would end with an error
            raise ConfigError(f"metrics.{key}={wait} must be below train.process_group_timeout_s="
                              f"{cfg.train.process_group_timeout_s}: the other ranks wait for rank 0 in a "
                              "collective meanwhile")
    if cfg.comera.enabled:
        _check_prunable(cfg.comera)
        check_factorization(cfg.model, cfg.comera)


def _check_prunable(comera: ComeraConfig) -> None:
    """A bond keeps at least ``pruning.min_rank`` ranks (all of them when it has fewer), and has at most its kind's
    ``max_rank``: a floor at or above every tensorized kind's cap makes the scheduled prunes slice nothing."""
    t, p = comera.tensorize, comera.pruning
    caps = {key: cap for key, cap, on in (("max_rank", t.max_rank, t.attention or t.ffn),
                                          ("embedding_max_rank", t.embedding_max_rank, t.embedding)) if on}
    if p.every and caps and p.min_rank >= max(caps.values()):
        bounds = " and ".join(f"comera.tensorize.{key}={cap}" for key, cap in caps.items())
        raise ConfigError(f"comera.pruning.min_rank={p.min_rank} would prune nothing: no bond has more ranks than "
                          f"{bounds}, and each keeps min_rank of them; lower it, or set comera.pruning.every=0")


def run_warnings(cfg: RunConfig) -> list[str]:
    """What a run takes but most likely does not mean, one line each: a warmup longer than the run (a smoke run's
    ``--set train.steps=20`` on a config with 1000 warmup steps) leaves the learning rate rising to the end. The
    run goes on; ``--check-config``, ``--dry-run`` and the trainer's rank 0 say it."""
    sched, steps = cfg.deepspeed.scheduler, cfg.train.steps
    if sched.kind == "constant" or sched.warmup_steps <= steps:
        return []
    reached = sched.warmup_min_ratio + (1.0 - sched.warmup_min_ratio) * steps / sched.warmup_steps  # linear warmup
    return [(f"deepspeed.scheduler.warmup_steps={sched.warmup_steps} exceeds train.steps={steps}: the learning rate "
             f"rises for the whole run, to about {reached:.0%} of its peak, and never decays ({sched.kind})")]


PRETRAIN_OBJECTIVES = {"bert_mlm": "mlm", "gpt": "causal"}
"""The ``data.objective`` each pretrainable ``model.arch`` learns."""


def check_pretrainable(cfg: RunConfig) -> None:
    """``comera pretrain`` trains a masked LM (``bert_mlm`` on ``mlm`` data) or a causal LM (``gpt`` on ``causal``
    data): a classifier has no pretraining loss, and a mismatched pair crashed at the first step (a GPT given
    MLM batches) or trained nothing useful (an encoder asked to copy its unmasked input). ``--dry-run`` and the
    benchmarks build any arch. Also what the run would refuse at its start, before any rank: a model vocabulary
    below the configured tokenizer's, and an output or cache directory that is a file (or under one)."""
    arch, objective = cfg.model.arch, cfg.data.objective
    if arch not in PRETRAIN_OBJECTIVES:
        raise ConfigError(f"model.arch={arch} is not pretrained by comera pretrain (a classifier: the paper's "
                          "six-encoder benchmark model); pretrain bert_mlm (data.objective=mlm; the six-encoder's "
                          "is configs/six-encoder-mlm.yaml) or gpt (data.objective=causal)")
    if objective != PRETRAIN_OBJECTIVES[arch]:
        raise ConfigError(f"data.objective={objective} does not train model.arch={arch}: set data.objective="
                          f"{PRETRAIN_OBJECTIVES[arch]}")
    from comera_dist.data.errors import DataError
    from comera_dist.data.prepare import check_compat

    try:  # the run checks it again with the tokenizer it builds; the configured vocabulary bounds it already
        check_compat(cfg.data, cfg.model.vocab_size, cfg.model.max_positions)
    except DataError as e:
        raise ConfigError(str(e)) from None
    # data.cache_dir may be read-only where every entry the run needs is built already (a shared, prebuilt
    # cache): a build there is refused by name when it comes (cache.publish)
    _check_directory_path("train.output_dir", Path(cfg.train.output_dir), writable=True)
    _check_directory_path("data.cache_dir", cfg.data.resolved_cache_dir())


def check_local_inputs(cfg: RunConfig) -> tuple[Path, dict[str, Any]] | None:
    """The local inputs a run reads once its ranks are up: ``data.files`` (``source: files``; each must exist and
    the builder be inferable), ``data.tokenizer.pretrained``, a ``train.resume`` path, and the checkpoint the run
    would resume, which must fit the config (``_resume_target``; returned with its meta, None for a fresh start).
    ``--check-config`` and ``--dry-run`` look on the submitting host (a cluster's shared filesystem), where a
    wrong path costs no queue wait; the run finds them again itself."""
    from comera_dist.data import sources
    from comera_dist.data.errors import DataError
    from comera_dist.data.tokenizer import pretrained_dir

    data = cfg.data
    try:
        if data.source == "files":
            sources.infer_builder(sources.resolve_paths(data.files), data.builder)
        if data.tokenizer.pretrained is not None:
            pretrained_dir(data.tokenizer.pretrained)
    except DataError as e:
        raise ConfigError(str(e)) from None
    resume, restarts = cfg.train.resume, slurm_restarts()
    # A requeued Slurm job (slurm/pretrain.sh checks at every start) resumes its own newest checkpoint instead
    # (checkpoint.requeued_spec), and its retention may have deleted the one named here by then.
    if not restarts:
        check_resume_path(resume)
    return _resume_target(cfg, restarts)


def check_resume_path(resume: str) -> None:
    """A ``train.resume`` path (not ``auto`` or ``none``) must exist: a run checks it before its data build."""
    if resume not in ("auto", "none") and not Path(resume).exists():
        raise ConfigError(f"train.resume={resume}: no such checkpoint or run directory (auto, none or a path)")


def _resume_target(cfg: RunConfig, restarts: int) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint the run would resume first and its meta (``checkpoint_layout.resume_candidate``), read only
    and checked against ``cfg``: a changed ``model.hidden_size`` under ``resume auto`` was refused only once the
    ranks were up, after a Slurm queue wait. None: a fresh start."""
    from comera_dist.engine import checkpoint_layout as layout  # no torch or DeepSpeed: a login node's check

    root = Path(cfg.train.output_dir) / "checkpoints"
    spec = layout.requeued_spec(cfg.train.resume, root, restarts, os.environ.get("SLURM_JOB_ID"))
    if restarts and spec not in ("auto", "none") and not Path(spec).exists():
        return None  # the requeued job's own path, gone by retention: the job finds its way (trainer._requeued)
    try:
        found = layout.resume_candidate(spec, root)
        if found is not None:
            layout.check_compatible(found[1], layout.identity(cfg), found[0], one_line=True)
    except layout.CheckpointError as e:
        raise ConfigError(f"train.resume={spec}: {e}") from None
    return found


def slurm_restarts() -> int:
    """How often Slurm has requeued this job (``SLURM_RESTART_COUNT``; 0 outside Slurm or unreadable)."""
    raw = os.environ.get("SLURM_RESTART_COUNT", "0")
    return int(raw) if raw.isdigit() else 0


def _check_directory_path(key: str, path: Path, *, writable: bool = False) -> None:
    """``path`` is a directory or can become one: its nearest existing ancestor (or itself) is a directory, and with
    ``writable`` one this user can write in. A run whose output directory is a file, or read-only, failed at the
    first write, on every rank, with a traceback."""
    at = nearest_existing(path)
    if not at.is_dir():
        raise ConfigError(f"{key}={path}: {at} is a file, not a directory")
    if writable and not os.access(at, os.W_OK | os.X_OK):  # a read-only mount (root too), another's directory
        raise ConfigError(f"{key}={path}: {at} is not writable by this user")


def layer_dims(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """(rows, cols) of each tensorizable layer kind: linear (in, out), embedding (vocab, hidden)."""
    h, f = model.hidden_size, model.intermediate_size
    return {"attention": (h, h), "ffn_in": (h, f), "ffn_out": (f, h), "embedding": (model.vocab_size, h)}


def check_factorization(model: ModelConfig, comera: ComeraConfig) -> None:
    """Explicit modes must multiply to the layer dims; automatic ones must exist (no mode of 1)."""
    t = comera.tensorize
    enabled = {"attention": t.attention, "ffn_in": t.ffn, "ffn_out": t.ffn, "embedding": t.embedding}
    for kind, (rows, cols) in layer_dims(model).items():
        if not enabled[kind]:
            continue
        key = f"comera.tensorize.modes.{kind}"
        if kind in t.modes:
            first, second = t.modes[kind]
            if kind == "embedding":
                if math.prod(first) < rows or math.prod(second) != cols:
                    raise ConfigError(f"{key}: row modes {first} (product {math.prod(first)}) must cover "
                                      f"model.vocab_size={rows} and column modes {second} (product "
                                      f"{math.prod(second)}) must equal model.hidden_size={cols}")
            elif math.prod(first) != rows or math.prod(second) != cols:
                raise ConfigError(f"{key}: modes {first} x {second} multiply to {math.prod(first)} x "
                                  f"{math.prod(second)}, but the layer is {rows} x {cols}")
            continue
        if kind == "embedding":
            continue  # row modes may pad the vocabulary, so an automatic TTM factorization always exists
        d = t.num_cores // 2
        for what, n in (("input", rows), ("output", cols)):
            modes = factorize(n, d)
            if d > 1 and 1 in modes:
                raise ConfigError(f"comera.tensorize.num_cores={t.num_cores}: the {kind} {what} dimension {n} "
                                  f"has no factorization into {d} modes > 1 (got {modes}); set {key} "
                                  "explicitly or change num_cores")


def resolved_dict(cfg: RunConfig) -> dict[str, Any]:
    """The fully resolved config as plain data (what is saved beside every checkpoint)."""
    return to_dict(cfg)
