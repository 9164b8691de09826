"""The launch/ scripts themselves: strict bash with a usage line, and ``--dry-run`` printing the exact
command (one process each: milliseconds, seconds where the trainer checks the config first; the real 2-rank jobs
are in tests/distributed/test_launchers.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = "configs/tiny-cpu.yaml"
SCRIPTS = ["launch/accelerator.sh", "launch/gpu_check.sh", "launch/gpu_wheels.sh", "launch/mpirun.sh",
           "launch/preflight.sh", "launch/pretrain_local.sh", "launch/setup.sh", "launch/test.sh", "launch/torchrun.sh",
           "slurm/child_status.sh", "slurm/node_launch.sh", "slurm/pretrain-cpu.sh", "slurm/pretrain.sh"]
# What a script could start: each is a stub on PATH (or named by the variable the script reads) that logs its call.
STUBS = ["pip", "pip3", "python", "python3", "deepspeed", "torchrun", "mpirun", "srun", "scontrol", "scancel",
         "sbatch", "apt-get", "sudo"]


def _env(**extra: str) -> dict[str, str]:
    """The caller's environment without the variables the scripts read, CPU DeepSpeed, then ``extra``."""
    read = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NPROC", "NP", "NNODES", "NODE_RANK",
            "TORCHRUN", "MPIRUN", "MPIRUN_ARGS")
    return {k: v for k, v in os.environ.items() if k not in read} | {"DS_ACCELERATOR": "cpu"} | extra


@pytest.mark.parametrize("script", ["pretrain_local.sh", "torchrun.sh", "mpirun.sh"])
def test_launch_script_is_strict_and_has_usage(script):
    text = (REPO / "launch" / script).read_text()
    assert "set -euo pipefail" in text and "# usage: launch/" + script in text
    assert subprocess.run(["bash", "-n", str(REPO / "launch" / script)], check=False).returncode == 0


def test_launch_scripts_dry_run_print_the_command():
    env = _env(MASTER_PORT="29555", NPROC="3", NP="3", NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.7")
    run = lambda *a: subprocess.run([*a], cwd=REPO, env=env, capture_output=True, text=True, check=False)
    p = run("launch/torchrun.sh", "--dry-run", "--config", TINY)
    assert p.returncode == 0
    assert p.stdout.split() == ["python3", "launch/torchrun.py", "--nnodes", "2", "--node-rank", "1",
                                "--nproc-per-node", "3", "--master-addr", "10.0.0.7", "--master-port", "29555",
                                "--max-restarts", "0", "launch/train.py", "--config", TINY]
    p = run("launch/mpirun.sh", "--dry-run", "--config", TINY)
    assert p.returncode == 0 and " -np 3 " in p.stdout and "--allow-run-as-root --oversubscribe" in p.stdout
    assert " -x MASTER_ADDR " in p.stdout  # the user's address reaches remote ranks
    del env["MASTER_ADDR"]  # none: not made up (ranks on one host meet on loopback; several hosts need it)
    p = run("launch/mpirun.sh", "--dry-run", "--config", TINY)
    assert p.returncode == 0 and "MASTER_ADDR" not in p.stdout and " -x MASTER_PORT " in p.stdout
    for script in ("launch/torchrun.sh", "launch/mpirun.sh"):
        p = run(script)  # no trainer arguments: the usage, exit 2
        assert p.returncode == 2 and "usage:" in p.stderr


@pytest.mark.parametrize("dry", [["--dry-run"], []])
def test_torchrun_on_several_nodes_needs_master_addr(dry, tmp_path):
    """Before, NNODES=2 without MASTER_ADDR met on 127.0.0.1: node 1 waited out torchrun's 600 s rendezvous alone."""
    calls = tmp_path / "calls"
    stub = tmp_path / "torchrun"
    stub.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n")
    stub.chmod(0o755)
    env = _env(NNODES="2", NODE_RANK="1", TORCHRUN=str(stub))
    p = subprocess.run(["launch/torchrun.sh", *dry, "--config", TINY], cwd=REPO, env=env, capture_output=True,
                       text=True, check=False)
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    assert p.stderr == ("torchrun.sh: NNODES=2 spans nodes but MASTER_ADDR is not set; export MASTER_ADDR=<address "
                        "of node rank 0>, the same on every node\n")
    assert not calls.exists()  # nothing started
    one_node = subprocess.run(["launch/torchrun.sh", "--dry-run", "--config", TINY], cwd=REPO,
                              env=env | {"NNODES": "1"}, capture_output=True, text=True, check=False)
    assert one_node.returncode == 0 and "--master-addr 127.0.0.1" in one_node.stdout, one_node.stderr


def test_torchrun_takes_an_interpreter_whose_path_has_spaces(tmp_path):
    """gpu_check.sh ran torchrun.sh with TORCHRUN="$PYTHON launch/torchrun.py", which is split on blanks: a checkout
    at "/a b" ran "/a" with "b/.venv/bin/python" as its script. COMERA_PYTHON is one path."""
    calls = tmp_path / "calls"
    python = tmp_path / "my venv" / "python"
    python.parent.mkdir()
    python.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > '{calls}'\n")
    python.chmod(0o755)
    env = _env(COMERA_PYTHON=str(python), NPROC="2")
    p = subprocess.run(["launch/torchrun.sh", "--config", TINY], cwd=REPO, env=env, capture_output=True, text=True,
                       check=False)
    assert p.returncode == 0, p.stderr
    assert calls.read_text().split("\n")[:3] == ["launch/torchrun.py", "--nnodes", "1"]
    dry = subprocess.run(["launch/torchrun.sh", "--dry-run", "--config", TINY], cwd=REPO, env=env,
                         capture_output=True, text=True, check=False)
    assert dry.returncode == 0, dry.stderr
    assert shlex.split(dry.stdout)[:2] == [str(python), "launch/torchrun.py"]  # the printed command pastes whole


@pytest.mark.parametrize("script", ["launch/torchrun.sh", "launch/mpirun.sh"])
def test_launchers_dry_run_is_the_trainers_check_of_the_run(script, tmp_path):
    """Their dry run printed a command for any config; the trainer checks it at the launch's world size first
    (torchrun.sh NNODES x NPROC, mpirun.sh NP), as slurm/pretrain.sh does: a refusal prints no command."""
    out_dir = tmp_path / "run"

    def dry_run(*sets: str, ranks: int) -> subprocess.CompletedProcess:
        # torchrun.sh: ranks nodes x 1 process (several nodes need the address of node rank 0)
        env = _env(NNODES=str(ranks), NPROC="1", NP=str(ranks), MASTER_ADDR="10.0.0.7")
        args = ["--config", TINY, "--set", f"train.output_dir={out_dir}", *sets]
        return subprocess.run([script, "--dry-run", *args], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=120, check=False)

    refused = f"{Path(script).name}: comera pretrain --dry-run refused this run (above); nothing started"
    p = dry_run("--set", "train.steps=0", ranks=2)
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    assert "comera pretrain: error: " in p.stderr and "train.steps must be >= 1, got 0" in p.stderr, p.stderr
    assert refused in p.stderr
    p = dry_run("--set", "deepspeed.train_batch_size=8", ranks=3)  # 8 is no multiple of 3 ranks x 4 per micro-batch
    assert p.returncode == 2 and "train_batch_size" in p.stderr and refused in p.stderr and p.stdout == "", p.stderr
    p = dry_run("--set", "deepspeed.train_batch_size=8", ranks=2)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[-6:] == ["--config", TINY, "--set", f"train.output_dir={out_dir}", "--set",
                                     "deepspeed.train_batch_size=8"]
    assert p.stderr == "DS_ACCELERATOR=cpu\n"
    assert not out_dir.exists()


def test_every_launch_and_slurm_script_is_listed():
    assert sorted(SCRIPTS) == sorted(str(p.relative_to(REPO)) for d in ("launch", "slurm") for p in (REPO / d).glob("*.sh"))


class Sandbox:
    """A copy of launch/ and slurm/ (no venv, nothing installed) run from an empty working directory, with
    every program a script could start replaced by a stub that logs its call: a script that starts nothing
    leaves the log empty, and one that writes nothing leaves both folders as they were."""

    def __init__(self, root: Path) -> None:
        self.repo, self.cwd, bindir, self.calls = root / "repo", root / "cwd", root / "bin", root / "calls.log"
        for d in ("launch", "slurm"):
            shutil.copytree(REPO / d, self.repo / d)
        for d in (self.cwd, bindir, root / "venv/bin"):
            d.mkdir(parents=True)
        self.calls.touch()
        for name in STUBS + ["nvidia-smi"]:
            stub = bindir / name
            # nvidia-smi as on a login node without a GPU: a line that is no GPU, exit 6
            body = 'echo "No devices were found"; exit 6' if name == "nvidia-smi" else "exit 0"
            stub.write_text(f'#!/bin/sh\necho "$(basename "$0") $*" >> {self.calls}\n{body}\n')
            stub.chmod(0o755)
            if name in ("python", "pip"):  # setup.sh's VENV
                (root / "venv/bin" / name).symlink_to(stub)
        keep = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "COMERA_", "DS_", "NPROC", "NP"))}
        self.env = keep | {"PATH": f"{bindir}:/usr/bin:/bin", "VENV": str(root / "venv"), "PIP": str(bindir / "pip"),
                           "PYTHON": str(bindir / "python"), "TORCHRUN": str(bindir / "torchrun"),
                           "MPIRUN": str(bindir / "mpirun"), "COMERA_HOME": str(self.repo)}
        self.before = self.files()

    def files(self) -> set[str]:
        return {str(p) for d in (self.repo, self.cwd) for p in d.rglob("*")}

    def run(self, script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(self.repo / script), *args], cwd=self.cwd, env=self.env | env,
                              capture_output=True, text=True, timeout=10, check=False)

    def started(self) -> str:
        return self.calls.read_text()

    def made(self) -> set[str]:
        return self.files() - self.before


@pytest.mark.parametrize("flag", ["--help", "-h"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_the_usage_and_does_nothing(script, flag, tmp_path):
    box = Sandbox(tmp_path)
    p = box.run(script, flag)
    assert p.returncode == 0, p.stderr
    assert re.search(r"^# usage\b", p.stdout, re.MULTILINE), p.stdout  # the header's usage line, on stdout
    header = []  # the comment block under the shebang, sbatch's directives aside: a usage cut short loses its end
    for line in (REPO / script).read_text().splitlines()[1:]:
        if not line.startswith("#"):
            break
        header += [] if line.startswith("#SBATCH") else [line]
    assert [line for line in header if line not in p.stdout.splitlines()] == [], p.stdout
    assert box.started() == "", box.started()
    assert box.made() == set()


@pytest.mark.parametrize("script", ["launch/torchrun.sh", "launch/mpirun.sh", "launch/pretrain_local.sh"])
def test_trainer_launchers_help_names_the_trainers_options(script, tmp_path):
    assert "comera pretrain --help" in Sandbox(tmp_path).run(script, "--help").stdout


@pytest.mark.parametrize("args", [["launch/gpu_wheels.sh", "--hlep"], ["launch/gpu_wheels.sh", "--dry-run", "--hlep"],
                                  ["launch/gpu_wheels.sh", "a", "b"], ["launch/gpu_check.sh", "--hlep"],
                                  ["launch/gpu_check.sh", "--dry-run", "--hlep"], ["launch/setup.sh", "--hlep"],
                                  ["launch/setup.sh", "--dev", "x"], ["slurm/pretrain.sh", "--hlep"],
                                  ["slurm/pretrain.sh", "--dry-run", "--hlep"], ["slurm/node_launch.sh"],
                                  ["launch/accelerator.sh"], ["launch/preflight.sh"], ["slurm/child_status.sh"]],
                         ids=" ".join)
def test_a_mistyped_option_is_a_usage_error_not_a_folder(args, tmp_path):
    box = Sandbox(tmp_path)
    p = box.run(*args)
    assert p.returncode == 2 and re.search(r"^# usage\b", p.stderr, re.MULTILINE), p.stdout + p.stderr
    assert box.started() == "" and box.made() == set(), (box.started(), box.made())


def _stub_torchrun(tmp_path: Path, body: str) -> dict[str, str]:
    """A ``python3`` first on PATH that runs ``body`` for node_launch.sh's ``python3 launch/torchrun.py``."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").write_text(f"#!/bin/sh\nexec {sys.executable} -c '{body}'\n")
    (bindir / "python3").chmod(0o755)
    return _env(PATH=f"{bindir}:{os.environ['PATH']}")


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_node_launch_exits_with_torchruns_own_status_when_it_ends_during_the_relay(tmp_path, sig):
    """A step signal reaches node_launch.sh and torchrun together. torchrun (here a stub that exits 7 on it)
    ended while the relay trap ran, and bash's ``wait`` gave 138 (128 + USR1) every time, or -1: the status that
    decides pretrain.sh's requeue and reaches sacct was lost. TERM reaches the keeper subshell too, which must
    outlive it to write the status."""
    ready = tmp_path / "ready"
    env = _stub_torchrun(tmp_path, f"import signal, sys, time; signal.signal({int(sig)}, lambda *a: sys.exit(7)); "
                                   f"open(\"{ready}\", \"w\").close(); time.sleep(60)")
    for _ in range(5):
        ready.unlink(missing_ok=True)
        p = subprocess.Popen(["slurm/node_launch.sh", "--nnodes", "1", "launch/train.py"], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        os.killpg(p.pid, sig)  # as Slurm signals a step: every process of it at once
        out, _ = p.communicate(timeout=30)
        assert p.returncode == 7, out
        assert f"{sig.name.removeprefix('SIG')} -> USR1 to the trainers under torchrun" in out, out


def test_pretrain_local_dry_run_json_stdout_is_the_json():
    p = subprocess.run(["launch/pretrain_local.sh", "--dry-run", "--json"], cwd=REPO, env=_env(CONFIG=TINY, NPROC="2"),
                       capture_output=True, text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["world_size"] == 2  # nothing else on stdout
    assert "would run: DS_ACCELERATOR=cpu deepspeed --num_gpus 2 " in p.stderr


def test_slurm_dry_run_needs_no_gpu_and_a_real_run_says_what_is_missing(tmp_path):
    box = Sandbox(tmp_path)  # nvidia-smi there lists no GPU, as on a login node
    (box.repo / "configs").mkdir()
    (box.repo / TINY).write_text("")
    p = box.run("slurm/pretrain.sh", "--dry-run", TINY)
    assert p.returncode == 0, p.stderr
    assert "--nproc-per-node <GPUs-per-node> --rdzv-backend c10d" in p.stdout and "device gpu" in p.stdout
    assert "COMERA_NPROC_PER_NODE" in p.stderr
    p = box.run("slurm/pretrain.sh", "--dry-run", TINY, COMERA_NPROC_PER_NODE="4")
    assert p.returncode == 0 and "--nproc-per-node 4 " in p.stdout, p.stderr
    p = box.run("slurm/pretrain.sh", TINY)  # not a dry run: a clear error before anything starts
    assert p.returncode == 2 and p.stderr.strip() == (
        "pretrain.sh: no GPU found on this node (nvidia-smi lists none); set COMERA_DEVICE=cpu "
        "(slurm/pretrain-cpu.sh) or COMERA_NPROC_PER_NODE"), p.stderr
    assert "srun" not in box.started(), box.started()
    p = box.run("slurm/pretrain.sh", "--dry-run", TINY, COMERA_NPROC_PER_NODE="0")
    assert p.returncode == 2 and "COMERA_NPROC_PER_NODE must be a positive integer, got '0'" in p.stderr


@pytest.mark.parametrize("venv", ["none", "without torch"])
@pytest.mark.parametrize("args", [["slurm/pretrain.sh", "--dry-run", TINY], ["slurm/pretrain.sh", TINY],
                                  ["launch/torchrun.sh", "--dry-run", "--config", TINY],
                                  ["launch/mpirun.sh", "--dry-run", "--config", TINY],
                                  ["launch/pretrain_local.sh", "--dry-run"], ["launch/pretrain_local.sh"]],
                         ids=" ".join)
def test_a_python_without_torch_is_a_missing_environment_not_a_refused_config(args, venv, tmp_path):
    """Without launch/setup.sh's .venv the trainer's check died on its ImportError, which pretrain.sh reported as
    a refused config (exit 2). The python it picks is named, exit 1, and nothing starts."""
    box = Sandbox(tmp_path)
    (box.repo / "configs").mkdir()
    (box.repo / TINY).write_text("")
    bare = box.repo / ".venv" if venv == "without torch" else tmp_path / "bare"  # no .venv: first on PATH
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    p = box.run(*args, PATH=f"{bare / 'bin'}:{box.env['PATH']}", PYTHONPATH="", COMERA_DEVICE="cpu")
    name = Path(args[0]).name
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stderr == (f"{name}: the Python environment lacks torch and comera_dist ({bare / 'bin/python'}, the "
                        "python on PATH): ./launch/setup.sh sets up .venv with torch and comera-dist, which the "
                        "launchers use; nothing started\n"), p.stderr
    started = [c for c in box.started().splitlines() if not c.startswith("nvidia-smi ")]  # accelerator.sh's probe
    assert p.stdout == "" and started == [], started


def test_gpu_check_dry_run_lists_its_steps_without_a_gpu_and_a_real_run_says_what_is_missing(tmp_path):
    box = Sandbox(tmp_path)  # nvidia-smi there lists no GPU, as on a login node
    p = box.run("launch/gpu_check.sh", "--dry-run", str(tmp_path / "out"))
    assert p.returncode == 0, p.stderr
    assert "gpu_check (gpu, <GPUs> process(es)" in p.stdout and "pretrain-recompute-graphs" in p.stdout
    assert " bench-six-encoder-peaks " in p.stdout
    assert "1 step(s) at a time" in p.stdout  # on a GPU each step has the card to itself
    p = box.run("launch/gpu_check.sh", "--dry-run", str(tmp_path / "out"), "--cpu-smoke")
    assert p.returncode == 0 and "2 step(s) at a time" in p.stdout, p.stdout + p.stderr
    p = box.run("launch/gpu_check.sh", "--dry-run", str(tmp_path / "out"), "--cpu-smoke", COMERA_CHECK_JOBS="0")
    assert p.returncode == 2 and "gpu_check: COMERA_CHECK_JOBS must be a positive integer, not '0'" in p.stderr
    p = box.run("launch/gpu_check.sh", str(tmp_path / "out"))
    assert p.returncode == 2 and "gpu_check: no GPU visible (nvidia-smi -L); use --cpu-smoke on a CPU" in p.stderr
    assert "torchrun" not in box.started() and "pytest" not in box.started(), box.started()


@pytest.mark.parametrize(("train_py", "finished"), [
    ('echo \'{"nothing_to_train": true}\'', 0),
    ('echo \'{"nothing_to_train": false}\'', 1),
    ("echo 'comera pretrain: error: train.steps must be >= 1' >&2; exit 2", 1),  # a refused config
    ("echo 'not json'", 1),
    ("sleep 30", 1),  # past COMERA_FINISHED_CHECK_S: the time limit is near
])
def test_a_requeue_is_skipped_only_when_the_check_says_the_run_is_finished(train_py, finished, tmp_path):
    """preflight.sh's comera_run_finished, which slurm/pretrain.sh asks before requeueing after a USR1: any
    answer but the trainer's own "nothing to train" keeps the requeue, since a run left unqueued is lost time."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python").write_text(f'#!/bin/bash\nif [ "$1" = launch/train.py ]; then {train_py}; exit; fi\n'
                                   f'exec {sys.executable} "$@"\n')
    (bindir / "python").chmod(0o755)
    start = time.monotonic()
    p = subprocess.run(["bash", "-c", ". launch/preflight.sh; comera_run_finished --config x.yaml"], cwd=REPO,
                       env=_env(PATH=f"{bindir}:{os.environ['PATH']}", COMERA_FINISHED_CHECK_S="2"),
                       capture_output=True, text=True, timeout=60, check=False)
    assert (p.returncode, p.stdout, p.stderr) == (finished, "", "")
    assert time.monotonic() - start < 20
