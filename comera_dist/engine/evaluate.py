"""``comera evaluate`` and ``comera export``: a checkpoint as a plain model, outside any process group.

A checkpoint directory holds the resolved config, the pruning plans (shapes) and DeepSpeed's
shards; the model is rebuilt at the saved shapes and loaded from the fp32 weights (ZeRO shards
merged by DeepSpeed's ``zero_to_fp32``). The tokenizer is the one the run saved under
``<output_dir>/tokenizer``. Every failure on the user's input is an ``InputError``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import sys
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn
from transformers import PreTrainedTokenizerBase

from comera_dist.compression.pruning import PruningPlan
from comera_dist.config import RunConfig, build_run_config
from comera_dist.configbase import ConfigError, nearest_existing
from comera_dist.data.collators import collator_for
from comera_dist.data.errors import DataError
from comera_dist.data.loader import eval_batches
from comera_dist.data.prepare import evaluation_corpus
from comera_dist.data.tokenizer import load_tokenizer, save_export_tokenizer, tokenizer_digest
from comera_dist.engine import checkpoint as ckpt
from comera_dist.engine.device import batches_to_device
from comera_dist.engine.errors import InputError
from comera_dist.engine.model_factory import build_run_model
from comera_dist.engine.packing import unpack_saved
from comera_dist.engine.prune import model_at_shapes
from comera_dist.engine.token_stats import label_token_sums
from comera_dist.metrics.progress import terminal_progress
from comera_dist.models.atomic import umask_modes
from comera_dist.models.gpt import GPT

CONSOLIDATED = "consolidated_fp32.pt"
READ_ATTEMPTS = 3
"""How often ``load_run`` reads a run's newest checkpoint when retention deletes it meanwhile."""

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadedRun:
    """A checkpoint rebuilt as a plain ``nn.Module`` with its config and tokenizer directory."""

    path: Path
    cfg: RunConfig
    model: nn.Module
    state: dict[str, torch.Tensor]
    tokenizer_dir: Path


def locate(spec: str | Path) -> Path:
    """A checkpoint directory from a run dir, a ``checkpoints`` dir or a checkpoint dir itself."""
    path = Path(spec)
    if not path.is_dir():
        raise InputError(f"--checkpoint {path}: " + ("a file, not a directory: give the run directory, its "
                                                     "checkpoints/ or one checkpoint's directory" if path.exists()
                                                     else "no such directory"))
    for candidate in (path, path / "checkpoints"):
        if ckpt.is_complete(candidate):
            return candidate
        found = ckpt.latest_complete(candidate, finish=False)  # read only: the run may be live
        if found is not None:
            return found
    raise InputError(f"--checkpoint {path}: no complete checkpoint there (expected a run directory, its "
                     f"checkpoints/ directory, or a checkpoint holding {ckpt.MARKER})")


def _fp32_state(path: Path, zero_stage: int) -> dict[str, torch.Tensor]:
    """The full fp32 weights of the checkpoint (ZeRO shards merged; stage 0 keeps them whole)."""
    if zero_stage == 0:
        files = sorted(path.glob("mp_rank_*_model_states.pt"))
        if not files:
            raise InputError(f"checkpoint {path}: no mp_rank_*_model_states.pt")
        # DeepSpeed stores non-tensor objects beside the weights; load_run gated them (verify_weights_only).
        return {k: v.float() for k, v in torch.load(files[0], map_location="cpu", weights_only=False)["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # it prints its progress on stdout, which is the commands' result (`comera evaluate --json`, export's path)
    # and a library caller's own output (``load_run`` in-process)
    with contextlib.redirect_stdout(sys.stderr):
        return get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)


def _read(path: Path, *, verified: bool = False) -> tuple[RunConfig, dict[str, Any]]:
    """The resolved config and side metadata of checkpoint ``path`` (no weights read), both first checked against
    its manifest unless ``verified`` (every file was): a damaged or hand-edited ``config.yaml`` is named as such,
    not as a config error of no file."""
    problems = [] if verified else ckpt.check(path, names=(ckpt.CONFIG, ckpt.META))
    if problems:
        raise InputError(f"checkpoint {path} fails verification: " + "; ".join(problems) + _instead(path))
    try:
        saved = yaml.safe_load((path / ckpt.CONFIG).read_text(encoding="utf-8"))
        # Outputs of the run that wrote it are irrelevant here (and a metrics key renamed since
        # must not make an old checkpoint unreadable): rebuild with today's metrics defaults.
        saved.pop("metrics", None)
        cfg = build_run_config(saved)
        meta = ckpt.read_meta(path)
    except (OSError, AttributeError, UnicodeDecodeError, ckpt.CheckpointError, yaml.YAMLError) as e:
        raise InputError(f"checkpoint {path}: {e}") from e
    except ConfigError as e:  # a pre-manifest checkpoint's, or one of a config key since removed
        raise InputError(f"checkpoint {path}: its {ckpt.CONFIG}: {e}") from e
    return cfg, meta


def _tokenizer_dir(path: Path, cfg: RunConfig) -> Path:
    beside = path.parent.parent / "tokenizer"  # <run>/checkpoints/<tag> -> <run>/tokenizer (moved runs)
    return beside if beside.is_dir() else Path(cfg.train.output_dir) / "tokenizer"


def _run_tokenizer(path: Path, cfg: RunConfig, meta: dict[str, Any]) -> PreTrainedTokenizerBase:
    """The tokenizer the run of checkpoint ``path`` saved, checked against it (``_check_tokenizer``). A missing
    one is an error naming where it was looked for (``load_tokenizer``'s own names ``data.tokenizer.pretrained``,
    a setting evaluate does not have)."""
    where = _tokenizer_dir(path, cfg)
    if not where.is_dir():
        looked = " or ".join(str(p) for p in dict.fromkeys([path.parent.parent / "tokenizer", where]))
        raise InputError(f"checkpoint {path}: no run tokenizer at {looked}; copy the run's tokenizer/ "
                         "directory beside its checkpoints/")
    try:
        tokenizer = load_tokenizer(where)
    except DataError as e:  # a damaged <run>/tokenizer
        raise InputError(str(e)) from e
    _check_tokenizer(path, where, tokenizer, cfg.model.vocab_size, meta)
    return tokenizer


def _check_tokenizer(path: Path, where: Path, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                     meta: dict[str, Any]) -> None:
    """The tokenizer at ``where`` is the one checkpoint ``path`` was trained with: the sha256 its meta records
    (``tokenizer_sha256``; checkpoints from before have none), and a vocabulary the model can index. A replaced
    ``<run>/tokenizer`` gave an evaluation of other tokens' ids without a word, and an export shipped it."""
    fix = f"put that run's own tokenizer/ directory at {where}"
    saved, ours = meta.get("tokenizer_sha256"), tokenizer_digest(tokenizer)
    if saved is not None and saved != ours:
        raise InputError(f"checkpoint {path}: the tokenizer at {where} is not the one it was trained with (sha256 "
                         f"{ours[:12]}, the checkpoint records {saved[:12]}), so its token ids would mean other "
                         f"tokens; {fix}")
    if len(tokenizer) > vocab_size:
        raise InputError(f"checkpoint {path}: the tokenizer at {where} has {len(tokenizer)} tokens, more than the "
                         f"model's vocab_size={vocab_size}: it is not the one the checkpoint was trained with; {fix}")


def load_run(spec: str | Path) -> LoadedRun:
    """Rebuild the model of a checkpoint at its saved (possibly pruned) shapes and load its weights.

    ``spec`` a run (or its ``checkpoints/``) directory: its newest complete checkpoint. A live run's retention
    may delete that one while it is read (a newer one was saved): it is then located and read again, up to
    ``READ_ATTEMPTS`` times. A checkpoint directory named itself is read once.

    The checkpoint's files are verified against its manifest first (sizes and digests, as a resume
    does): a corrupted or truncated file is an ``InputError`` naming it, never a silently wrong
    evaluation or export. A run directory whose newest checkpoint is damaged is an error too (no
    quiet fallback to an older one): pass that older checkpoint's directory explicitly. The manifest
    detects corruption, not tampering, and the weights are read with ``weights_only=False`` (ours at
    ZeRO 0, DeepSpeed's ``zero_to_fp32`` above): every shard passes ``ckpt.verify_weights_only`` first.
    """
    explicit = ckpt.is_complete(Path(spec))
    last: Exception | None = None
    for attempt in range(1, READ_ATTEMPTS + 1):
        path = locate(spec)
        try:
            return _load(path)
        except Exception as e:
            if ckpt.is_complete(path):  # not deleted under us: the failure is the checkpoint's own
                raise
            if explicit:
                raise InputError(f"--checkpoint {path} was deleted while it was read ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''})") from e
            last = e
            if attempt < READ_ATTEMPTS:
                log.warning("checkpoint %s was deleted while it was read (the live run kept a newer one); reading "
                            "the newest again (attempt %d of %d)", path, attempt + 1, READ_ATTEMPTS)
    raise InputError(f"--checkpoint {spec}: its newest checkpoint was deleted while it was read, "
                     f"{READ_ATTEMPTS} times in a row (the run saves and prunes its checkpoints faster than one can "
                     "be read); pass a kept checkpoint's directory (train.keep_every) or raise "
                     "train.keep_checkpoints") from last


def _load(path: Path) -> LoadedRun:
    """``load_run`` of the checkpoint directory ``path``."""
    problems = ckpt.check(path)
    if problems:
        raise InputError(f"checkpoint {path} fails verification: " + "; ".join(problems) + _instead(path))
    try:
        ckpt.verify_weights_only(path)
    except ckpt.CheckpointError as e:  # the message names the shard
        raise InputError(f"checkpoint {path} is refused: {e}{_instead(path)}") from e
    cfg, meta = _read(path, verified=True)
    plans = [PruningPlan.from_json(text) for text in meta.get("plans", [])]
    model = model_at_shapes(lambda: build_run_model(cfg), plans)
    state = _fp32_state(path, int(meta.get("zero_stage", cfg.deepspeed.zero_stage)))
    try:
        unpack_saved(model, state)  # a packed run's shards (deepspeed.pack_vectors) hold flat parameters per role
    except ValueError as e:
        raise InputError(f"checkpoint {path} does not match its config's model: {e}") from e
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in dict(model.named_buffers())]
    if missing or unexpected:
        raise InputError(f"checkpoint {path} does not match its config's model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    model.eval()
    return LoadedRun(path=path, cfg=cfg, model=model, state=state, tokenizer_dir=_tokenizer_dir(path, cfg))


def _instead(path: Path) -> str:
    """The refusal's way on: the newest other checkpoint beside ``path`` whose files verify. ``load_run`` never
    falls back to it by itself (a run directory's newest is what the user asked for), but names it for
    ``--checkpoint``. Only on failure, so reading older checkpoints' digests costs nothing otherwise."""
    if not ckpt.is_complete(path):  # deleted while read (a live run's retention): load_run reads the newest again
        return ""
    for other in reversed(ckpt.complete_checkpoints(path.parent)):
        if other != path and not ckpt.check(other):
            return f"; the newest checkpoint there that verifies is {other}: pass --checkpoint {other} to use it"
    return f"; no other checkpoint in {path.parent} verifies"


@torch.no_grad()
def evaluate_checkpoint(checkpoint: str | Path, data: Sequence[str], *, batch_size: int = 8,
                        max_batches: int | None = None, seed: int = 0, text_column: str | None = None) -> dict[str, Any]:
    """Token-weighted MLM (or causal) loss and arg-max accuracy of a checkpoint on local files. JSON/Parquet rows
    give ``text_column`` (None: the checkpoint's ``data.text_column``, the run's own files' column)."""
    if batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {batch_size}")
    if max_batches is not None and max_batches < 1:
        raise InputError(f"--max-batches must be >= 1 (or left out for the whole corpus), got {max_batches}")
    path = locate(checkpoint)  # its config and tokenizer: the data first, so bad input fails before any weights
    cfg, meta = _read(path)
    column, setting = ((text_column, "--text-column") if text_column is not None else
                       (cfg.data.text_column, "the checkpoint's data.text_column (--text-column sets another)"))
    tokenizer = _run_tokenizer(path, cfg, meta)
    try:
        blocks = evaluation_corpus(data, tokenizer, seq_len=cfg.data.seq_len, objective=cfg.data.objective,
                                   text_column=column, column_setting=setting,
                                   show_progress=sys.stderr.isatty(),  # a large corpus takes a while to read
                                   too_short="the checkpoint fixes data.seq_len: give --data more text")
        collator = collator_for(cfg.data.objective, tokenizer, cfg.data.mlm_probability)
        batches = list(eval_batches(blocks, batch_size=batch_size, rank=0, world_size=1, seed=seed,
                                    collator=collator,
                                    max_blocks=None if max_batches is None else max_batches * batch_size))
    except DataError as e:
        raise InputError(str(e)) from e
    # what the user named, not ``path``: on a live run retention may delete that one meanwhile and load_run
    # then reads the newest (the same run: its config and tokenizer stay those read above)
    run = load_run(checkpoint)
    device = next(run.model.parameters()).device  # the model's device: batches go through the one mover
    on_device = terminal_progress(batches_to_device(batches, device), desc="evaluate", total=len(batches),
                                  unit="batch")
    loss_sum, correct, count = label_token_sums(run.model, on_device, causal=isinstance(run.model, GPT))
    count = int(count)
    return {"checkpoint": str(run.path), "loss": loss_sum / count if count else math.nan,
            "accuracy": correct / count if count else math.nan, "masked_tokens": count,
            "batches": len(batches), "blocks": len(blocks), "objective": cfg.data.objective}


def _check_out(out: Path) -> None:
    """``out`` can take an export: absent or an empty directory, and its nearest existing ancestor a directory
    this process may create entries in. ``export_checkpoint`` checks it before loading any weights (minutes
    for a large model), and ``_publish_dir`` again at the write (``out`` may have appeared meanwhile)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InputError(f"--out {out}: exists and is not an empty directory")
    at = nearest_existing(out.parent)  # the export is made beside out and renamed into place
    if not at.is_dir():
        raise InputError(f"--out {out}: {at} is a file, not a directory")
    if not os.access(at, os.W_OK | os.X_OK):
        raise InputError(f"--out {out}: cannot create it, {at} is not writable")


@contextlib.contextmanager
def _publish_dir(out: Path) -> Iterator[Path]:
    """Fill a temporary sibling of ``out``, then rename it into place (never a half-written export). The sibling
    is made on entry, so a directory that refuses it (root squashing, ACLs: what ``_check_out``'s ``os.access``
    cannot see) fails before the caller loads anything; a failure leaves none of the parents it made."""
    _check_out(out)
    made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]  # innermost first
    # A plain mkdir, not mkdtemp: the export gets the mode (umask, default ACLs) of any directory made there,
    # not mkdtemp's 0700 that locks teammates on a shared cluster out of it.
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    published = False
    try:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
        except OSError as e:
            raise InputError(f"--out {out}: cannot create it in {out.parent}: {e.strerror or e}") from e
        yield tmp
        umask_modes(tmp)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
        published = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        for parent in made if not published else ():
            if not parent.exists():
                continue  # never made: the mkdir failed above it
            try:
                parent.rmdir()
            except OSError:  # filled meanwhile by someone else
                break


def _token_ids(tokenizer_dir: Path) -> dict[str, int | None]:
    """The run tokenizer's special ids for an exported model's config (none without a tokenizer)."""
    if not tokenizer_dir.is_dir():
        return {}
    tok = load_tokenizer(tokenizer_dir)
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, fmt: str = "dense-hf") -> Path:
    """Write the checkpoint as ``dense-hf`` (transformers ``save_pretrained``), ``tt`` (compact TT
    cores with their shapes) or ``consolidated`` (one fp32 state-dict file); returns ``out``."""
    from comera_dist.models.export import export_dense
    from comera_dist.models.tt_io import save_tt

    if fmt not in ("dense-hf", "tt", "consolidated"):
        raise InputError(f"--format {fmt!r} is not one of dense-hf, tt, consolidated")
    out = Path(out)
    _check_out(out)
    path = locate(checkpoint)  # a replaced tokenizer is refused before any weights load
    cfg, meta = _read(path)
    if _tokenizer_dir(path, cfg).is_dir():  # exported with the model; an export without one is the model alone
        _run_tokenizer(path, cfg, meta)
    with _publish_dir(out) as tmp:  # made first: the weights of a large model take minutes to load
        run = load_run(checkpoint)
        if fmt == "dense-hf":
            export_dense(run.model, tmp, token_ids=_token_ids(run.tokenizer_dir))
        elif fmt == "tt":
            save_tt(run.model, tmp)
        else:
            torch.save(run.state, tmp / CONSOLIDATED)
            shutil.copy(run.path / ckpt.CONFIG, tmp / ckpt.CONFIG)
            shutil.copy(run.path / ckpt.META, tmp / ckpt.META)
        if run.tokenizer_dir.is_dir():  # every format's copy is set for the exported model, not for packing
            model = run.cfg.model
            try:
                save_export_tokenizer(run.tokenizer_dir, tmp, max_length=model.max_positions,
                                      objective=run.cfg.data.objective, pair_type_id=int(model.type_vocab_size > 1))
            except DataError as e:  # a damaged <run>/tokenizer
                raise InputError(str(e)) from e
    return out
