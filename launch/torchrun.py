#!/usr/bin/env python
"""``torchrun`` that exits with the status of the rank that failed first, not always 1.

torchrun turns any failed worker into a ``ChildFailedError`` and exits 1, so a job's status could not tell bad
input (2) from non-finite losses (3) or collapsed ranks (4), which ``comera pretrain --help`` documents and the
``deepspeed`` launcher passes through. Here the failure summary (each rank's ``exitcode : N``) is printed as
torchrun prints it, without the launcher's own traceback, and the first failure's status is the exit status: a
rank killed by signal N gives 128 + N, as a shell reports it. Arguments: torchrun's (``launch/torchrun.sh`` and
``slurm/node_launch.sh`` run it).
"""

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main


def first_failure_status(error: ChildFailedError) -> int:
    """The exit status of ``error``'s first failed rank (128 + N for signal N; 1 when it recorded 0)."""
    _, failure = error.get_first_failure()
    code = failure.exitcode
    return 128 - code if code < 0 else (code or 1)


if __name__ == "__main__":
    try:
        main()
    except ChildFailedError as e:
        print(e, file=sys.stderr)
        sys.exit(first_failure_status(e))
