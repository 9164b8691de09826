"""``engine.build.scheduler_start_quiet``: DeepSpeed's warmup schedulers warn in their own constructor that
it is too early to ask them for a learning rate; engine builds drop that one message, and only while they
build."""

from __future__ import annotations

import logging

import pytest
import torch
from deepspeed.runtime.lr_schedules import WarmupCosineLR, WarmupDecayLR
from deepspeed.utils import logger

from comera_dist.engine.build import SCHEDULER_NOT_STARTED, scheduler_start_quiet


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def records():
    handler = Records()
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def _schedulers() -> None:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    WarmupDecayLR(opt, total_num_steps=10, warmup_num_steps=2)
    WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=2)


def test_deepspeed_warns_when_its_warmup_schedulers_are_built(records):
    """The premise: without the filter DeepSpeed 0.19.8 warns once per scheduler (if an upgrade stops, this
    goes red and the filter can go)."""
    _schedulers()
    assert records.count(SCHEDULER_NOT_STARTED) == 2


def test_engine_builds_drop_that_warning_and_only_it(records):
    with scheduler_start_quiet():
        _schedulers()
        logger.warning("another warning")
    assert records == ["another warning"]
    _schedulers()  # after the build the filter is gone
    assert records.count(SCHEDULER_NOT_STARTED) == 2
