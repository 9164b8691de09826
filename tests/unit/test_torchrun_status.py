"""``launch/torchrun.py``: the failed rank's own status, where torchrun exits 1 for any failure (the 2-rank jobs
of ``tests/distributed/test_failures.py`` see 3 and 4 through ``launch/torchrun.sh``)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

status = runpy.run_path(str(Path(__file__).parents[2] / "launch" / "torchrun.py"))["first_failure_status"]


def _failed(*exitcodes: int) -> ChildFailedError:
    failures = {rank: ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=code, error_file="<N/A>")
                for rank, code in enumerate(exitcodes)}
    for rank, failure in failures.items():
        failure.timestamp = 1000 + rank  # rank 0 failed first
    return ChildFailedError("launch/train.py", failures)


@pytest.mark.parametrize(("exitcodes", "expected"), [((4, 4), 4), ((2,), 2), ((3, 1), 3), ((-9, -15), 137), ((0,), 1)])
def test_the_status_is_the_first_failed_ranks(exitcodes, expected):
    assert status(_failed(*exitcodes)) == expected
