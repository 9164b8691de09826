"""Each launcher (deepspeed, torchrun, mpirun) runs a short 2-process CPU training through launch/;
killing one rank with SIGKILL makes the whole job exit non-zero within 60 s.

The helpers at the top (``start_job``, ``rank_processes``, ...) are reused by test_failures.py.
Every job is a real process tree started through the scripts in launch/, on its own port.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = "configs/tiny-cpu.yaml"
# The corpus/tokenizer cache is content-keyed: every test job shares one, built by the first job.
CACHE = Path(os.environ.get("COMERA_TEST_CACHE", Path(tempfile.gettempdir()) / "comera-dist-test-cache"))
LAUNCH = {
    "deepspeed": ["launch/pretrain_local.sh"],
    "torchrun": ["launch/torchrun.sh", "--config", TINY],
    "mpirun": ["launch/mpirun.sh", "--config", TINY],
}


def job_env(port: int, **extra: str) -> dict[str, str]:
    """The environment of a launched job: the venv first on PATH, CPU DeepSpeed, offline HF,
    a fresh rendezvous port, and no rank variables inherited from the test process."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PATH=f"{REPO / '.venv' / 'bin'}:{env['PATH']}", MASTER_PORT=str(port), CONFIG=TINY,
               COMERA_CACHE=str(CACHE), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_overrides(out_dir: Path, *sets: str) -> list[str]:
    """``--set`` arguments for a test run writing under ``out_dir``."""
    args = ["--set", f"train.output_dir={out_dir}", "--set", "metrics.prometheus=false"]
    for s in sets:
        args += ["--set", s]
    return args


class Job:
    """One launched job: its process (a new session, so cleanup can kill the whole tree) and log."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=self._log_file, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log_file.flush()

    def wait_for(self, pattern: str, timeout: float) -> None:
        """Block until ``pattern`` (regex) appears in the log; fail if the job ends first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if re.search(pattern, self.text()):
                return
            if self.proc.poll() is not None:
                pytest.fail(f"job exited ({self.proc.returncode}) before {pattern!r}:\n{self.text()[-4000:]}")
            time.sleep(0.2)
        pytest.fail(f"{pattern!r} not seen within {timeout} s:\n{self.text()[-4000:]}")

    def kill_tree(self) -> None:
        """SIGKILL every process this job started (the session started with it)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._log_file.close()


def start_job(launcher: str, args: list[str], env: dict[str, str], log: Path) -> Job:
    return Job([*LAUNCH[launcher], *args], env, log)


def rank_processes(job: Job) -> dict[int, psutil.Process]:
    """Global rank -> process, for the launch/train.py processes of ``job`` (read from their env:
    RANK from deepspeed/torchrun, OMPI_COMM_WORLD_RANK from mpirun)."""
    ranks: dict[int, psutil.Process] = {}
    for p in psutil.Process(job.proc.pid).children(recursive=True):
        try:
            if not any(a.endswith("launch/train.py") for a in p.cmdline()):
                continue
            env = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rank = env.get("RANK", env.get("OMPI_COMM_WORLD_RANK"))
        if rank is not None:
            ranks[int(rank)] = p
    return ranks


def checkpoint_tags(out_dir: Path) -> list[str]:
    """Published checkpoint tags under a run directory (``latest`` names the newest)."""
    root = out_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def jobs():
    """Starts jobs and always tears their process trees down."""
    started: list[Job] = []

    def _start(launcher: str, args: list[str], env: dict[str, str], log: Path) -> Job:
        job = start_job(launcher, args, env, log)
        started.append(job)
        return job

    yield _start
    for job in started:
        job.kill_tree()


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun", "mpirun"])
def test_launcher_trains_two_ranks(launcher, jobs, tmp_path, port):
    out = tmp_path / "run"
    job = jobs(launcher, run_overrides(out, "train.steps=3", "train.checkpoint_every=0"), job_env(port),
               tmp_path / "job.log")
    rc = job.wait(timeout=240)
    log = job.text()
    assert rc == 0, log[-4000:]
    # Both processes joined one 2-rank job, each discovered through its launcher's mechanism.
    for rank in (0, 1):
        assert re.search(rf"rank {rank}/2 .*discovery", log), log[-4000:]
    assert "step 3/3" in log, log[-4000:]
    # No Python warning reaches the job's log (torch 2.13 deprecates the all-gather DeepSpeed's ZeRO step makes).
    assert not re.search(r"^\S+:\d+: \w*Warning: ", log, re.MULTILINE), log[-4000:]
    # ZeRO-1 writes one optimizer shard per rank: proof that two data-parallel ranks trained.
    ckpt = out / "checkpoints"
    shards = sorted(p.name for p in ckpt.rglob("*optim_states.pt"))
    assert any("zero_pp_rank_0_" in s for s in shards) and any("zero_pp_rank_1_" in s for s in shards), shards


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun", "mpirun"])
def test_killed_rank_ends_job_within_60s(launcher, jobs, tmp_path, port):
    out = tmp_path / "run"
    job = jobs(launcher, run_overrides(out, "train.steps=100000", "train.log_every=1"), job_env(port),
               tmp_path / "job.log")
    job.wait_for(r"step 2/", timeout=180)  # both ranks are inside the training loop
    ranks = rank_processes(job)
    assert sorted(ranks) == [0, 1], ranks
    ranks[1].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    try:
        rc = job.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{launcher}: job still running 60 s after rank 1 was killed:\n{job.text()[-3000:]}")
    elapsed = time.monotonic() - t0
    assert rc != 0, f"{launcher} exited 0 after a rank was SIGKILLed"
    leftovers = [p for p in ranks.values() if _alive(p)]
    assert not leftovers, f"ranks left running: {leftovers}"
    print(f"{launcher}: exit {rc} {elapsed:.1f} s after SIGKILL of rank 1")
