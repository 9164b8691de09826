"""SlurmCluster: a real loopback Slurm cluster for tests (slurm/ci/up.sh, down.sh) and job helpers."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class SlurmCluster:
    """One cluster at a time (fixed ports and state dir); ``ensure(n, gpus)`` swaps the node layout."""

    def __init__(self, workdir: Path, port: int) -> None:
        self.dir = workdir
        self.port = port
        self.nnodes = 0
        self.gpus = 0
        self.env = os.environ | {"SLURM_CI_DIR": str(workdir), "SLURM_CI_PORT": str(port),
                                 "SLURM_CONF": str(workdir / "etc/slurm.conf")}

    def ensure(self, nnodes: int, gpus: int = 0) -> SlurmCluster:
        """A cluster of ``nnodes`` nodes with ``gpus`` fake GPU GRES each (restarted if different)."""
        if (self.nnodes, self.gpus) != (nnodes, gpus):
            self.down()
            self.gpus = gpus
            r = subprocess.run([REPO / "slurm/ci/up.sh", str(nnodes)], env=self.env | {"SLURM_CI_FAKE_GPUS": str(gpus)},
                               capture_output=True,
                               text=True, timeout=120, check=False)
            assert r.returncode == 0, f"slurm/ci/up.sh {nnodes} failed:\n{r.stdout}{r.stderr}"
            self.nnodes = nnodes
        return self

    def down(self) -> None:
        if self.nnodes:
            subprocess.run([REPO / "slurm/ci/down.sh"], env=self.env, capture_output=True, timeout=120, check=False)
            self.nnodes = 0

    def run(self, *cmd: str | Path, check: bool = True) -> str:
        r = subprocess.run([str(c) for c in cmd], env=self.env, cwd=REPO, capture_output=True, text=True,
                           timeout=60, check=False)
        if check and r.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, cmd))} -> {r.returncode}:\n{r.stdout}{r.stderr}")
        return r.stdout

    def sbatch(self, *args: str | Path) -> int:
        return int(self.run("sbatch", "--parsable", *args).strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (accounting is off: this is where state lives)."""
        text = self.run("scontrol", "show", "job", "-o", str(job_id))
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job_id: int, timeout: float) -> dict[str, str]:
        """Poll until the job reaches a final state; return its final ``scontrol`` record.

        A requeued job passes through PENDING (Reason=BeginTime for the cluster's cred_expire,
        10 s in slurm/ci/up.sh) and runs again; only a final state ends the wait.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info["JobState"] in {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}:
                return info
            time.sleep(0.5)
        self.run("scancel", str(job_id), check=False)
        raise TimeoutError(f"job {job_id} still {self.job(job_id)['JobState']} after {timeout}s")

    def nodes_idle(self) -> bool:
        states = self.run("sinfo", "-h", "-N", "-o", "%t").split()
        return len(states) == self.nnodes and all(s == "idle" for s in states)

    def logs(self, lines: int = 15) -> str:
        """Tail of every daemon log, for assertion messages."""
        out = []
        for f in sorted((self.dir / "log").glob("*.log")):
            out.append(f"--- {f.name}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-lines:]))
        return "\n".join(out)

    def wait_for_text(self, path: Path, pattern: str, timeout: float, job_id: int) -> None:
        """Wait until ``path`` (a job log) matches ``pattern``; fail early if the job ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and re.search(pattern, path.read_text(errors="replace"), re.MULTILINE):
                return
            if self.job(job_id)["JobState"] not in {"PENDING", "CONFIGURING", "RUNNING"}:
                break
            time.sleep(0.25)
        log = path.read_text(errors="replace") if path.exists() else "(no log)"
        raise TimeoutError(f"{pattern!r} not in {path} (job {job_id} {self.job(job_id)['JobState']}):\n{log}")


    def usr1_when(self, log: Path, pattern: str, job_id: int, timeout: float) -> tuple[dict[str, str], str]:
        """Slurm's time-limit warning once the job's log matches ``pattern``: USR1 to its batch shell (which
        forwards it to the trainers); then the job's final record and its whole log."""
        self.wait_for_text(log, pattern, timeout=timeout, job_id=job_id)
        self.run("scancel", "--signal=USR1", "--batch", str(job_id))
        info = self.wait(job_id, timeout=timeout)
        return info, log.read_text()

def cpu_overrides(log: Path, **env: str) -> list[str]:
    """sbatch options turning slurm/pretrain.sh's GPU defaults into a loopback CPU job."""
    exports = ",".join(["ALL", "COMERA_DEVICE=cpu", f"COMERA_HOME={REPO}"] + [f"{k}={v}" for k, v in env.items()])
    return ["--partition=debug", "--gres=none", "--mem=1G", "--cpus-per-task=1", "--time=10",
            f"--output={log}", f"--export={exports}"]


def free_port_block(n: int) -> int:
    """First port of ``n`` consecutive free loopback ports (slurmctld, slurmd, one per emulated node)."""
    for base in range(17000, 40000, 97):
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports between 17000 and 40000")
