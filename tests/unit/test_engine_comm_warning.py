"""``engine.distributed.quiet_all_gather_deprecation``: DeepSpeed 0.19.8 all-gathers through torch's
``all_gather_into_tensor``, which torch 2.13 deprecates with a FutureWarning on every rank; the trainer's
process ignores that one warning and no other."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from deepspeed.comm.torch import TorchBackend

from comera_dist.engine.distributed import ALL_GATHER_DEPRECATED, quiet_all_gather_deprecation


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
