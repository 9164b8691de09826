"""Building the model (``deepspeed.zero.Init`` at ZeRO-3) and the DeepSpeed engine with param groups by role."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import deepspeed
from torch import nn

from comera_dist.compression.config import ComeraConfig
from comera_dist.compression.groups import param_groups
from comera_dist.engine.config import DeepSpeedSection, to_deepspeed_dict
from comera_dist.engine.device import accelerator_device, buffers_to
from comera_dist.engine.distributed import disable_shm_op
from comera_dist.engine.packing import pack_vectors, packed_of

ModelFactory = Callable[[], nn.Module]
SCHEDULER_NOT_STARTED = "Attempting to get learning rate from scheduler before it has started"


@dataclass(slots=True)
class Built:
    """What ``deepspeed.initialize`` returned, plus the JSON it was given."""

    engine: Any
    optimizer: Any
    scheduler: Any
    ds_config: dict[str, Any]
    group_names: list[str]


def construct_model(factory: ModelFactory, section: DeepSpeedSection, *, world_size: int) -> nn.Module:
    """``factory()``, partitioned by ``deepspeed.zero.Init`` at ZeRO-3 (``p.shape`` is then empty and
    the real shape lives in ``p.ds_shape``).

    ``section.zero3_init == "convert"`` builds the whole model first, then hands it to
    ``zero.Init(module=...)``: always correct, but each rank briefly holds the full model.
    ``"construct"`` builds inside the ``zero.Init`` context, so no rank ever holds it all;
    this is only correct for models that initialise every parameter inside the constructor
    of the module that owns it (a parent re-initialising a child's weight after the child's
    constructor returned writes into an already partitioned, empty tensor).
    """
    if section.zero_stage != 3:
        return factory()
    disable_shm_op()
    # zero.Init needs only the ZeRO/precision part of the config; the lrs are placeholders.
    cfg = to_deepspeed_dict(section, world_size, total_steps=1, group_lrs=[1.0])
    if section.zero3_init == "construct":
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = factory()
    else:
        model = factory()
        deepspeed.zero.Init(module=model, config_dict_or_path=cfg)  # moves the parameters only
    return buffers_to(model, accelerator_device())


def packs(section: DeepSpeedSection) -> bool:
    """Whether engines of ``section`` train the 1-D parameters packed per role (``deepspeed.pack_vectors``,
    ZeRO 0-2)."""
    return section.pack_vectors and section.zero_stage != 3


def initialize(model: nn.Module, comera: ComeraConfig, section: DeepSpeedSection, *, world_size: int,
               total_steps: int) -> Built:
    """``deepspeed.initialize`` with AdamW param groups by role (cores, gates, dense) and their lrs,
    the 1-D parameters packed into one flat parameter per role first where ``packs(section)``."""
    if packs(section) and packed_of(model) is None:
        pack_vectors(model)
    groups = param_groups(model, comera.lr)
    if not groups:
        raise ValueError(f"{type(model).__name__} has no trainable parameters")
    ds_config = to_deepspeed_dict(section, world_size, total_steps=total_steps,
                                  group_lrs=[g["lr"] for g in groups], weight_decay=comera.lr.weight_decay)
    disable_shm_op()
    with scheduler_start_quiet():
        engine, optimizer, _, scheduler = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config)
    packed = packed_of(model)
    if packed is not None:
        packed.install(detached=True)  # views of the flat parameters DeepSpeed moved, cast and re-viewed
    return Built(engine=engine, optimizer=optimizer, scheduler=scheduler, ds_config=ds_config,
                 group_names=[g["name"] for g in groups])


@contextmanager
def scheduler_start_quiet() -> Iterator[None]:
    """Drop one DeepSpeed warning while an engine is built: its warmup schedulers ask themselves for a
    learning rate in their constructor, before their first step, and warn that it is too early (DeepSpeed
    0.19.8, ``runtime/lr_schedules.py``). That is one WARNING per rank at the start and at every physical
    prune, about nothing in the run. Outside an engine build the warning is left alone."""
    from deepspeed.utils import logger

    def drop(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(SCHEDULER_NOT_STARTED)

    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def destroy(engine: Any) -> None:
    """``engine.destroy()``, and what it leaves behind that would keep the engine alive for good.

    Two module-level references of ZeRO-3 outlive ``destroy()`` (DeepSpeed 0.19.8), each a way to the engine:
    - ``parameter_offload.FWD_MODULE_STACK``, a list every ZeRO-3 engine adds its module to and none removes
      it from; the module's forward hooks (which ``destroy()`` leaves) hold the engine;
    - the parameter coordinator's ``__params_to_release``, an ``lru_cache`` on the class keyed by coordinator,
      which holds the old coordinator, its parameters and, through them, the optimizer.
    So the engine, its optimizer's fp32 partitions and moments, and its process groups stayed alive: one more
    engine for every physical prune and resume of a ZeRO-3 job, until the interpreter's teardown. Both are
    dropped here (``tests/distributed/test_checkpoint_trainer.py`` counts the engines alive after a job; each
    one left in place, the count is 1).
    """
    module = getattr(engine, "module", None)
    engine.destroy()
    from deepspeed.runtime.zero import parameter_offload, partitioned_param_coordinator

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if module is not None and isinstance(stack, list):
        stack[:] = [m for m in stack if m is not module]
    coordinator = partitioned_param_coordinator.PartitionedParameterCoordinator
    cached = _lru_cache_of(getattr(coordinator, "_PartitionedParameterCoordinator__params_to_release", None))
    if cached is not None:
        cached.cache_clear()  # a class-wide cache keyed by coordinator: live ones refill it


def _lru_cache_of(fn: Any, depth: int = 4) -> Any:
    """The ``functools.lru_cache`` wrapper inside ``fn``'s decorators (DeepSpeed's nvtx wrapper keeps it in its
    closure), or None."""
    for _ in range(depth):
        if fn is None or hasattr(fn, "cache_clear"):
            return fn
        inner = [v for v in map(_contents, getattr(fn, "__closure__", None) or ()) if callable(v)]
        fn = getattr(fn, "__wrapped__", None) or next(iter(inner), None)
    return None


def _contents(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None
