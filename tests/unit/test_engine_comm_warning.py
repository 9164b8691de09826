"""``engine.distributed.quiet_all_gather_deprecation``: DeepSpeed 0.19.8 all-gathers through torch's
``all_gather_into_tensor``, which torch 2.13 deprecates with a FutureWarning on every rank; the trainer's
process ignores that one warning and no other. Likewise torch's notice that a barrier of a one-rank NCCL
group uses the current device (the device ``init_distributed`` selected)."""

from __future__ import annotations

import inspect
import re
import warnings

import pytest
import torch
import torch.distributed as tdist
from deepspeed.comm.torch import TorchBackend

from comera_dist.engine.distributed import (
    ALL_GATHER_DEPRECATED,
    BARRIER_DEVICE_NOTICE,
    quiet_all_gather_deprecation,
    quiet_barrier_device_notice,
)


def _deepspeed_all_gather() -> None:
    """DeepSpeed's own all-gather function, called with no process group: torch warns, then refuses."""
    gather = TorchBackend.get_all_gather_function()
    with pytest.raises(ValueError, match="process group"):
        gather(output_tensor=torch.empty(2), input_tensor=torch.empty(1))


def test_deepspeed_gathers_through_the_deprecated_call():
    """The premise (if a DeepSpeed or torch upgrade stops the warning, this goes red and the filter can go)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _deepspeed_all_gather()
    assert [w.category for w in seen if re.search(ALL_GATHER_DEPRECATED, str(w.message))] == [FutureWarning]


def test_the_process_ignores_that_warning_and_only_it():
    with warnings.catch_warnings(record=True) as seen:  # puts the process's filters back afterwards
        warnings.simplefilter("always")
        quiet_all_gather_deprecation()
        _deepspeed_all_gather()
        warnings.warn("another deprecation", FutureWarning)
    assert [str(w.message) for w in seen] == ["another deprecation"]


def test_torch_still_warns_about_a_barrier_without_a_bound_device():
    """The premise of the barrier filter: torch's ``barrier`` carries the notice the filter matches (red if a
    torch upgrade rewords or drops it; then the filter can go)."""
    source = inspect.getsource(tdist.distributed_c10d.barrier)
    assert re.search(BARRIER_DEVICE_NOTICE, source)


def test_the_process_ignores_the_barrier_device_notice_and_only_it():
    notice = ("barrier(): using the device under current context. You can specify `device_id` in "
              "`init_process_group` to mute this warning.")  # torch 2.11's text, as the H200 logs print it
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_barrier_device_notice()
        warnings.warn(notice, UserWarning)
        warnings.warn("barrier(): something else", UserWarning)
    assert [str(w.message) for w in seen] == ["barrier(): something else"]
