"""Inductor's compile workers survive Slurm's stop signals (``engine.signals.StopRequest``).

Slurm signals every process of a step. The compile workers (a sidecar and its process pool, which inductor
starts from the main thread at its first Triton kernel, after the trainer watches the stop signals) had no
USR1 handler: USR1 killed them, and the next kernel compile waited on the dead pool for ever. The trainer's
``StopRequest`` blocks the signals in the main thread, and the pool inherits that mask. Each case runs in its
own process, whose pool lives as long as it does. On CPU inductor compiles no Triton kernel and starts no pool,
so the cases here start it as inductor does; the ``gpu`` case lets a real CUDA compile start it
(launch/gpu_check.sh runs it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from proc_testlib import communicate_or_kill

PROGRAM = """
import json, operator, os, signal, subprocess, sys, time
from comera_dist.engine.signals import STOP_SIGNALS, StopRequest
from torch._inductor import async_compile

if sys.argv[1] == "guarded":  # the trainer's order: the stop signals watched, then the first compile
    stop = StopRequest(STOP_SIGNALS)
    async_compile.maybe_warm_pool()  # what inductor's first Triton kernel does, from the main thread
else:  # a pool started before the signals are watched: unprotected
    async_compile.maybe_warm_pool()
    stop = StopRequest(STOP_SIGNALS)
assert async_compile._pool_set  # a pool runs
pool = async_compile.AsyncCompile.process_pool()
assert pool.submit(operator.add, 1, 2).result(timeout=120) == 3  # the sidecar's workers are up

def blocked(pid):
    line = [l for l in open(f"/proc/{pid}/status") if l.startswith("SigBlk:")][0]
    mask = int(line.split()[1], 16)
    return [s.name for s in STOP_SIGNALS if mask >> (s - 1) & 1]

sidecar = pool.process.pid
workers = subprocess.run(["pgrep", "-P", str(sidecar)], capture_output=True, text=True).stdout.split()
procs = [sidecar] + [int(w) for w in workers]
masks = {str(p): blocked(p) for p in procs}
for p in procs + [os.getpid()]:
    os.kill(p, signal.SIGUSR1)  # scancel --signal=USR1: every process of the step
time.sleep(1)
try:
    answer = pool.submit(operator.add, 3, 4).result(timeout=float(sys.argv[2]))
except TimeoutError:
    answer = None
print(json.dumps({"workers": len(workers), "masks": masks, "answer": answer, "trainer": stop.signal_name}))
os._exit(0)  # a dead pool's shutdown would wait on it
"""


def _run(mode: str, wait_s: float) -> dict:
    p = subprocess.run([sys.executable, "-c", PROGRAM, mode, str(wait_s)], capture_output=True, text=True,
                       timeout=300, check=False)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.mark.slow
def test_a_stop_signal_leaves_the_compile_workers_working():
    got = _run("guarded", 60)
    assert got["workers"] >= 1 and all(m == ["SIGUSR1", "SIGTERM"] for m in got["masks"].values()), got
    assert got["answer"] == 7, got  # the pool still compiles
    assert got["trainer"] == "SIGUSR1", got  # the trainer saw it


@pytest.mark.slow
def test_without_the_guard_a_stop_signal_kills_the_pool():
    """The failure itself, so that the case above shows a difference: the pool never answers again."""
    got = _run("plain", 10)
    assert all(m == [] for m in got["masks"].values()) and got["answer"] is None, got


CUDA_PROGRAM = """
import json, operator, os, signal, subprocess, sys, time
from comera_dist.engine.signals import STOP_SIGNALS, StopRequest
import torch
from torch._inductor import async_compile

stop = StopRequest(STOP_SIGNALS)  # what comera pretrain does before its first compile
x = torch.randn(4096, device="cuda")
first = torch.compile(lambda t: (t.sin() * 2).sum())
first(x)  # inductor's first Triton kernel: it starts its compile pool here, from whichever thread it chooses
if not async_compile._pool_set:
    sys.exit("inductor compiled the first Triton kernel without its process pool (compile_threads=1?)")
pool = async_compile.AsyncCompile.process_pool()
assert pool.submit(operator.add, 1, 2).result(timeout=120) == 3  # the sidecar's workers are up
sidecar = pool.process.pid
workers = subprocess.run(["pgrep", "-P", str(sidecar)], capture_output=True, text=True).stdout.split()
masks = {}
for p in [sidecar] + [int(w) for w in workers]:
    line = [l for l in open(f"/proc/{p}/status") if l.startswith("SigBlk:")][0]
    masks[str(p)] = [s.name for s in STOP_SIGNALS if int(line.split()[1], 16) >> (s - 1) & 1]
os.killpg(0, signal.SIGUSR1)  # Slurm's step-wide USR1: every process of this session
time.sleep(1)
second = torch.compile(lambda t: (t.cos() + 1).amax())  # a new kernel after the signal: a dead pool hangs here
got = float(second(x))
print(json.dumps({"workers": len(workers), "masks": masks, "ok": abs(got - float((x.cos() + 1).amax())) < 1e-5,
                  "trainer": stop.signal_name}))
os._exit(0)
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (inductor's Triton compile pool)")
@pytest.mark.timeout(240)
def test_a_stop_signal_during_a_cuda_compile_run_leaves_compiling_working():
    """The real path: a CUDA compile starts the pool under the trainer's mask, and Slurm's USR1 to the whole
    session (the trainer, the sidecar, its workers) leaves the next compile working."""
    proc = subprocess.Popen([sys.executable, "-c", CUDA_PROGRAM], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    out, err = communicate_or_kill(proc, 200, "the compile after the USR1 hung (a dead compile pool)")
    assert proc.returncode == 0, err[-3000:]
    got = json.loads(out.splitlines()[-1])
    assert got["workers"] >= 1 and all(m == ["SIGUSR1", "SIGTERM"] for m in got["masks"].values()), got
    assert got["ok"] and got["trainer"] == "SIGUSR1", got
