#!/usr/bin/env python
"""The per-rank script the ``deepspeed``, ``torchrun`` and ``mpirun`` launchers run.

It is ``comera pretrain`` (see ``comera pretrain --help``); each launcher gives the process
its rank through the environment (or MPI), and ``engine.distributed`` reads it.
"""

import sys

from comera_dist.cli import pretrain_main

if __name__ == "__main__":
    sys.exit(pretrain_main())
