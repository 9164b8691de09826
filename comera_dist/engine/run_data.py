"""The data side of one rank of a run: prepared corpus, train iterator, validation batches.

Wraps ``comera_dist.data``: local rank 0 of each node builds the cache while the other ranks
wait at a barrier; model/data compatibility is checked before and after the build, and bad
data input surfaces as ``InputError`` (the CLI prints one line and exits 2).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as tdist
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from comera_dist.config import RunConfig
from comera_dist.data import DataConfig
from comera_dist.data.errors import DataError
from comera_dist.data.loader import PackedLoader, eval_batches
from comera_dist.data.prepare import PreparedData, check_compat, prepare_data, prepare_tokenizer
from comera_dist.data.tokenizer import (
    load_tokenizer,
    save_run_tokenizer,
    tokenizer_digest,
    tokenizer_files,
    tokenizer_from_files,
)
from comera_dist.engine import checkpoint as ckpt
from comera_dist.engine.config import solve_batch_sizes
from comera_dist.engine.device import accelerator_device
from comera_dist.engine.distributed import DistInfo
from comera_dist.engine.errors import InputError

Batch = dict[str, Tensor]


@contextlib.contextmanager
def input_errors() -> Iterator[None]:
    """Turn the data pipeline's bad-input errors into ``InputError`` (one line, exit 2)."""
    try:
        yield
    except DataError as e:
        raise InputError(str(e)) from e


@dataclass(slots=True)
class RunData:
    """This rank's batches: ``train`` is the resumable iterator whose state rides in checkpoints."""

    prepared: PreparedData
    train: PackedLoader
    cfg: RunConfig
    info: DistInfo
    micro_batch: int
    accumulation: int

    def next_train_batches(self) -> list[Batch]:
        """The micro-batches of one optimizer step on this rank, each ``(micro, seq_len)``."""
        return [next(self.train) for _ in range(self.accumulation)]

    def validation_batches(self) -> Iterator[Batch]:
        """This rank's share of the validation pass (``train.eval_batches``), the same blocks and masks at every
        evaluation and world size."""
        return eval_batches(self.prepared.validation, batch_size=self.micro_batch, rank=self.info.rank,
                            world_size=self.info.world_size, seed=self.cfg.train.seed,
                            collator=self.prepared.collator,
                            max_blocks=self.cfg.train.eval_batches * self.micro_batch)

    @property
    def tokens_per_step(self) -> int:
        """Tokens consumed by one optimizer step over all ranks."""
        return self.micro_batch * self.accumulation * self.info.world_size * self.cfg.data.seq_len

    @property
    def tokenizer_digest(self) -> str:
        """``data.tokenizer.tokenizer_digest`` of the run's tokenizer (the same on every rank)."""
        return tokenizer_digest(self.prepared.tokenizer)

    def save_tokenizer(self, path: Path) -> None:
        """Write the tokenizer beside the checkpoints, where ``comera evaluate`` and a resume read it."""
        save_run_tokenizer(self.prepared.tokenizer, Path(path))


@contextlib.contextmanager
def build_group(info: DistInfo, timeout_s: float) -> Iterator[Any]:
    """A gloo group of every rank whose collectives wait ``timeout_s`` (``train.data_build_timeout_s``): the ranks
    wait in it while the data is built. A first build of a large corpus takes longer than the job's
    collective timeout (``train.process_group_timeout_s``), which would fail the waiting ranks. None (the
    default group) in a one-rank job. Collective."""
    if info.world_size == 1:
        yield None
        return
    group = tdist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    try:
        yield group
    finally:
        tdist.destroy_process_group(group)


def build_barrier(group: Any, timeout_s: float) -> None:
    """``tdist.barrier`` in the build group. A wait past ``timeout_s``, or a rank gone meanwhile, is a
    ``DataError`` naming ``train.data_build_timeout_s`` (gloo's own error names neither the key nor the build)."""
    try:
        tdist.barrier(group=group)
    except RuntimeError as e:  # gloo: "Timed out waiting <N>ms ...", or "Connection closed by peer ..."
        raise DataError(f"the data build did not finish on every rank within train.data_build_timeout_s="
                        f"{timeout_s:g} s, or a rank failed meanwhile (its log says why); a first build of a large "
                        f"corpus takes longer: raise train.data_build_timeout_s ({e})") from e


def run_tokenizer(cfg: DataConfig, info: DistInfo, given: Path | None, *, group: Any,
                  timeout_s: float) -> PreTrainedTokenizerBase:
    """The run's tokenizer, global rank 0's on every rank (collective in ``group``, whose waits last
    ``timeout_s``: ``train.data_build_timeout_s``).

    Rank 0 loads ``given`` (the tokenizer beside the checkpoint a resume continues from) or prepares the
    configured one (cached, or trained on its node's corpus), and sends its files to the other ranks,
    which wait at a barrier meanwhile, as they do for the data build. Training it on each node would not
    do: the ``tokenizers`` WordPiece trainer numbers (and picks) tokens in hash-map order, different in every
    process, so two nodes with node-local caches, or a requeue onto a node whose cache is empty, would get
    other ids for the same text."""
    show = info.rank == 0 and sys.stderr.isatty()
    if info.world_size == 1:
        return load_tokenizer(given) if given is not None else prepare_tokenizer(cfg, show_progress=show)
    box: list[Any] = [None]
    if info.rank == 0:
        try:
            tok = load_tokenizer(given) if given is not None else prepare_tokenizer(cfg, show_progress=show)
            box[0] = tokenizer_files(tok)
        finally:  # also on failure: the others must not wait for a tokenizer that is not coming
            build_barrier(group, timeout_s)
            tdist.broadcast_object_list(box, src=0, group=group)
        return tok
    build_barrier(group, timeout_s)
    tdist.broadcast_object_list(box, src=0, group=group)
    if box[0] is None:
        raise DataError("rank 0 could not prepare the run's tokenizer (its log says why)")
    return tokenizer_from_files(box[0])


def resume_tokenizer_dir(output_dir: Path, resume: str) -> Path | None:
    """The tokenizer a run resumed with ``resume`` (auto|none|path) must keep: ``<run>/tokenizer`` of the run
    whose checkpoints it continues (``save_tokenizer`` writes it at the run's start). None for a fresh start,
    and where there is none to keep (the configured tokenizer is used; the checkpoint's recorded digest is
    checked at the resume). Reads the file system only: ``checkpoint.choose`` picks the checkpoint later."""
    if resume == "none":
        return None
    if resume == "auto":
        root = Path(output_dir) / "checkpoints"
    else:
        path = Path(resume)
        root = path if ckpt.complete_checkpoints(path) else path.parent
    found = root.is_dir() and (ckpt.complete_checkpoints(root) or any(root.glob(f"{ckpt.TMP_PREFIX}*")))
    tokenizer = root.parent / "tokenizer"
    return tokenizer if found and tokenizer.is_dir() else None


def build_run_data(cfg: RunConfig, info: DistInfo, *, tokenizer_dir: Path | None = None) -> RunData:
    """Prepare the data on every rank (collective: every rank must call it).

    ``tokenizer_dir``: the tokenizer to keep (a resumed run's own, ``resume_tokenizer_dir``), else the
    configured one. Either way global rank 0's (``run_tokenizer``)."""
    sizes = solve_batch_sizes(cfg.deepspeed, info.world_size)
    with input_errors():
        check_compat(cfg.data, cfg.model.vocab_size, cfg.model.max_positions)  # before any build
        # Bars on rank 0's terminal only: in a log file (Slurm) each redraw is a '\r'-joined fragment, and the
        # pipeline logs each artefact it builds.
        wait_s = cfg.train.data_build_timeout_s
        with build_group(info, wait_s) as group:
            tokenizer = run_tokenizer(cfg.data, info, tokenizer_dir, group=group, timeout_s=wait_s)
            prepared = prepare_data(cfg.data, rank=info.local_rank, world_size=info.world_size,
                                    show_progress=info.rank == 0 and sys.stderr.isatty(),
                                    barrier=lambda: build_barrier(group, wait_s), tokenizer=tokenizer)
        check_compat(cfg.data, cfg.model.vocab_size, cfg.model.max_positions, tokenizer=prepared.tokenizer)
        # Collation on a prefetch thread; pinned batches on CUDA, so the engine's copy is asynchronous.
        loader = PackedLoader(prepared.train, batch_size=sizes.micro_batch, rank=info.rank,
                              world_size=info.world_size, seed=cfg.train.seed, collator=prepared.collator,
                              prefetch=True, pin_memory=accelerator_device().type == "cuda")
        if len(prepared.validation) < info.world_size:
            raise DataError(f"the validation split has {len(prepared.validation)} blocks, fewer than the "
                            f"{info.world_size} ranks; raise data.validation_fraction or use more data")
    return RunData(prepared=prepared, train=loader, cfg=cfg, info=info, micro_batch=sizes.micro_batch,
                   accumulation=sizes.accumulation)
