"""The data side of one rank of a run: prepared corpus, train iterator, validation batches.

Wraps ``comera_dist.data``: local rank 0 of each node builds the cache while the other ranks
wait at a barrier; model/data compatibility is checked before and after the build, and bad
data input surfaces as ``InputError`` (the CLI prints one line and exits 2).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import deepspeed.comm as dist
from torch import Tensor

from comera_dist.config import RunConfig
from comera_dist.data.errors import DataError
from comera_dist.data.loader import PackedLoader, eval_batches
from comera_dist.data.prepare import PreparedData, check_compat, prepare_data
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
        """The same ``train.eval_batches`` validation batches (same masks) at every evaluation."""
        return eval_batches(self.prepared.validation, batch_size=self.micro_batch, rank=self.info.rank,
                            world_size=self.info.world_size, seed=self.cfg.train.seed,
                            collator=self.prepared.collator, max_batches=self.cfg.train.eval_batches)

    @property
    def tokens_per_step(self) -> int:
        """Tokens consumed by one optimizer step over all ranks."""
        return self.micro_batch * self.accumulation * self.info.world_size * self.cfg.data.seq_len

    def save_tokenizer(self, path: Path) -> None:
        """Write the tokenizer beside the checkpoints (``comera evaluate`` reads it), atomically."""
        path = Path(path)
        if path.is_dir():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tokenizer-", dir=path.parent))
        self.prepared.tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, path)


def build_run_data(cfg: RunConfig, info: DistInfo) -> RunData:
    """Prepare the data on every rank (collective: every rank must call it)."""
    sizes = solve_batch_sizes(cfg.deepspeed, info.world_size)
    with input_errors():
        check_compat(cfg.data, cfg.model.vocab_size, cfg.model.max_positions)  # before any build
        # Bars on rank 0's terminal only: in a log file (Slurm) each redraw is a '\r'-joined fragment, and the
        # pipeline logs each artefact it builds.
        prepared = prepare_data(cfg.data, rank=info.local_rank, world_size=info.world_size,
                                show_progress=info.rank == 0 and sys.stderr.isatty(), barrier=dist.barrier)
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
