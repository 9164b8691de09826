"""Real Slurm on loopback (1 node, 2 emulated nodes) driving slurm/pretrain.sh with a small real gloo program.

These prove the script's plumbing (srun per node, torchrun c10d rendezvous over the
nodes' NodeAddr, log per job, USR1 forward, requeue, --resume auto) with
``tests/ops/programs/count_steps.py``; test_slurm_pretrain.py runs the real trainer.
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest
from opsmarks import REPO, requires_slurm
from slurmharness import cpu_overrides, free_port_block

pytestmark = [pytest.mark.slow, pytest.mark.distributed, requires_slurm]
PROGRAM = "tests/ops/programs/count_steps.py"


def _submit(cluster, tmp_path, *, steps: int, nodes: int = 1, step_s: float = 0.1, cpu_script: bool = False,
            status: int = 0):
    """sbatch the GPU script with CPU overrides, or the CPU variant with only its log and program set."""
    log = tmp_path / "job.out"
    env = {"COMERA_TRAIN_SCRIPT": PROGRAM, "COMERA_RDZV_PORT": str(free_port_block(1))}
    if cpu_script:
        options = [f"--output={log}", "--export=" + ",".join(["ALL", f"COMERA_HOME={REPO}"] +
                                                             [f"{k}={v}" for k, v in env.items()])]
    else:
        options = cpu_overrides(log, **env)
    script = REPO / ("slurm/pretrain-cpu.sh" if cpu_script else "slurm/pretrain.sh")
    job = cluster.sbatch(f"--nodes={nodes}", *options, script, "README.md",
                         "--set", f"steps={steps}", "--set", f"out={tmp_path / 'run'}", "--set", f"step_s={step_s}",
                         "--set", f"status={status}")
    return job, log


def test_trivial_batch_job_runs(slurm_1node, tmp_path):
    job = slurm_1node.sbatch(f"--output={tmp_path}/%j.out", "--wrap", "echo node=$SLURMD_NODENAME; exit 3")
    info = slurm_1node.wait(job, timeout=60)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "3:0")
    assert (tmp_path / f"{job}.out").read_text().strip() == "node=localhost"


def test_dry_run_prints_resolved_launch(slurm_1node):
    r = subprocess.run([REPO / "slurm/pretrain.sh", "--dry-run", "configs/tiny-cpu.yaml", "--set", "train.steps=1"],
                       cwd=REPO, env=slurm_1node.env | {"COMERA_DEVICE": "cpu"}, capture_output=True, text=True,
                       check=False)
    assert r.returncode == 0, r.stderr
    assert "--rdzv-endpoint 127.0.0.1:20000" in r.stdout
    assert "launch/train.py --config configs/tiny-cpu.yaml --resume auto --set train.steps=1" in r.stdout


@pytest.mark.parametrize(("job_id", "port"), [("19999", 27999), ("12345", 20345)])
def test_the_rendezvous_port_is_below_the_ephemeral_range(slurm_1node, job_id, port):
    """Job 19999 met on 39999 before: in Linux's ephemeral range (32768-60999), where an outgoing connection on the
    head node can hold it."""
    r = subprocess.run([REPO / "slurm/pretrain.sh", "--dry-run", "configs/tiny-cpu.yaml"], cwd=REPO,
                       env=slurm_1node.env | {"COMERA_DEVICE": "cpu", "SLURM_JOB_ID": job_id}, capture_output=True,
                       text=True, check=False)
    assert r.returncode == 0, r.stderr
    assert f"--rdzv-endpoint 127.0.0.1:{port} --rdzv-id comera-{job_id}" in r.stdout


@pytest.mark.parametrize(("args", "env", "needle"), [
    (["configs/tiny-cpu.yaml", "--set", "train.stepz=5"], {"SLURM_JOB_NUM_NODES": "1"}, "did you mean 'steps'"),
    (["configs/codebert.yaml"], {"SLURM_JOB_NUM_NODES": "3", "COMERA_NPROC_PER_NODE": "8"}, "train_batch_size"),
])
def test_a_run_the_trainer_would_refuse_stops_before_any_node_starts(slurm_1node, args, env, needle):
    """Inside an allocation, the trainer's dry run at the job's world size (3 nodes x 8: 24 ranks, which
    codebert's batch does not divide), in the dry run and before srun: one error line, not one per rank."""
    r = subprocess.run([REPO / "slurm/pretrain.sh", "--dry-run", *args], cwd=REPO,
                       env=slurm_1node.env | {"COMERA_DEVICE": "cpu"} | env, capture_output=True, text=True,
                       check=False)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert "comera pretrain --dry-run refused this run (above); nothing started" in r.stderr
    assert "srun" not in r.stdout


def test_bad_config_path_is_a_clear_error(slurm_1node):
    r = subprocess.run([REPO / "slurm/pretrain.sh", "--dry-run", "configs/nope.yaml"], cwd=REPO,
                       env=slurm_1node.env, capture_output=True, text=True, check=False)
    assert r.returncode == 2 and "config file 'configs/nope.yaml' not found" in r.stderr


def test_sbatch_test_only_accepts_gpu_defaults_overridden(slurm_1node, tmp_path):
    # the script's own #SBATCH lines (gpu partition, 8 GPUs, 64 CPUs) do not fit here; overrides do
    def dry_submit(*options):  # sbatch --test-only reports on stderr, accepted or not
        return subprocess.run(["sbatch", "--test-only", *map(str, options), REPO / "slurm/pretrain.sh", "README.md"],
                              env=slurm_1node.env, cwd=REPO, capture_output=True, text=True, check=False)

    ok = dry_submit(*cpu_overrides(tmp_path / "x.out"))
    assert ok.returncode == 0 and "to start at" in ok.stderr, ok.stderr
    bad = dry_submit()
    assert bad.returncode != 0 and bad.stderr.strip(), bad.stdout + bad.stderr
    assert "to start at" not in bad.stdout + bad.stderr


def test_one_node_job_completes_with_log_and_checkpoint(slurm_1node, tmp_path):
    job, log = _submit(slurm_1node, tmp_path, steps=5)
    info = slurm_1node.wait(job, timeout=120)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), text
    assert "rank 0/2" in text and "rank 1/2" in text and "saved checkpoint at step 5 (done)" in text
    assert json.loads((tmp_path / "run/checkpoint.json").read_text()) == {"step": 5, "world": 2}


def test_a_failed_runs_status_is_the_jobs(slurm_1node, tmp_path):
    """The trainer's statuses (2 bad input, 3 non-finite, 4 collapsed) reach sacct's ExitCode through srun and the
    node's torchrun (launch/torchrun.py; torchrun itself exits 1 for any failed worker)."""
    job, log = _submit(slurm_1node, tmp_path, steps=2, status=4)
    info = slurm_1node.wait(job, timeout=120)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "4:0", "0"), log.read_text()


def test_usr1_checkpoints_requeues_and_resumes(slurm_1node, tmp_path):
    job, log = _submit(slurm_1node, tmp_path, steps=150, step_s=0.05, cpu_script=True)  # exec keeps the trap
    info, text = slurm_1node.usr1_when(log, r"^step 10$", job, timeout=240)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        text + slurm_1node.logs()
    stopped = int(re.search(r"saved checkpoint at step (\d+) \(stop SIGUSR1\)", text).group(1))
    assert 10 <= stopped < 150
    assert "requeueing job" in text
    # the requeued run resumed where the first stopped and finished the remaining steps
    assert re.search(rf"rank 0/2 .* start step {stopped}\b", text), text
    assert f"step {stopped + 1}\n" in text and "saved checkpoint at step 150 (done)" in text
    assert json.loads((tmp_path / "run/checkpoint.json").read_text())["step"] == 150


def test_two_emulated_nodes_rendezvous(slurm_2nodes, tmp_path):
    job, log = _submit(slurm_2nodes, tmp_path, steps=3, nodes=2, cpu_script=True)
    info = slurm_2nodes.wait(job, timeout=120)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("COMPLETED", "0:0", "n[1-2]"), text
    # 2 nodes x 2 processes in one process group, rendezvous on the head node's NodeAddr
    assert "on 2 node(s) (n[1-2]), head n1=127.0.0.2" in text
    # not anchored: the 4 processes share the log and their lines can interleave
    ranks = re.findall(r"rank (\d)/4 on \S+ node (n\d) MASTER_ADDR=127\.0\.0\.2 start step 0", text)
    assert sorted(r for r, _ in ranks) == ["0", "1", "2", "3"], text
    assert sorted(n for _, n in ranks) == ["n1", "n1", "n2", "n2"], text  # one torchrun per node, 2 procs each
    assert "saved checkpoint at step 3 (done)" in text


def test_gpu_defaults_take_gpu_count_from_slurm(slurm_2nodes, tmp_path):
    """The GPU script's own defaults (partition gpu, GRES) with only sizes overridden: P = GPUs per node."""
    job = slurm_2nodes.sbatch("--nodes=2", "--gres=gpu:2", "--mem=1G", "--cpus-per-task=1", f"--output={tmp_path}/%j.out",
                              f"--export=ALL,COMERA_HOME={REPO}", REPO / "slurm/pretrain.sh", "--dry-run",
                              "configs/tiny-cpu.yaml")
    info = slurm_2nodes.wait(job, timeout=60)
    text = (tmp_path / f"{job}.out").read_text()
    assert (info["JobState"], info["Partition"]) == ("COMPLETED", "gpu"), text
    assert "2 process(es)/node, device gpu" in text
    assert "--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.2:" in text
    assert "--kill-on-bad-exit=1 --cpus-per-task=1 slurm/node_launch.sh" in text  # the job's, given to srun again


def test_node_launch_on_a_node_slurm_does_not_know_says_so(slurm_1node):
    """The real scontrol, asked for a node the cluster lacks: before, node_launch.sh ended with rc 1 and no line."""
    r = subprocess.run([REPO / "slurm/node_launch.sh", "--nnodes", "1", "launch/train.py"], cwd=REPO,
                       env=slurm_1node.env | {"SLURMD_NODENAME": "n9"}, capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 1 and r.stdout == "", r.stdout + r.stderr
    # scontrol's own complaint, which the pipe into grep used to swallow
    assert r.stderr == "node_launch.sh: no NodeAddr for this node from 'scontrol show node n9': Node n9 not found\n"


def test_scancel_stops_without_requeue(slurm_1node, tmp_path):
    """A plain scancel (SIGTERM to every process) ends the job for good: pretrain.sh must not requeue it."""
    job, log = _submit(slurm_1node, tmp_path, steps=400, step_s=0.05)
    slurm_1node.wait_for_text(log, r"^step 5$", timeout=120, job_id=job)
    slurm_1node.run("scancel", str(job))
    info = slurm_1node.wait(job, timeout=120)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), log.read_text()
    time.sleep(3)  # a wrongly requeued job would be PENDING again by now
    assert slurm_1node.job(job)["JobState"] == "CANCELLED"
    assert "requeueing job" not in log.read_text() and "not requeueing" in log.read_text()


def test_outside_an_allocation_the_batch_arithmetic_waits_for_the_job(slurm_1node):
    """No node count yet: a config valid for the job's size (4 nodes x 8 ranks: 32 x 2 x 32 = 2048) is not
    refused at some other size; the dry run says where it is checked. Its keys are checked."""
    def dry_run(setting: str) -> subprocess.CompletedProcess:
        return subprocess.run([REPO / "slurm/pretrain.sh", "--dry-run", "configs/codebert.yaml", "--set", setting],
                              cwd=REPO, env={k: v for k, v in slurm_1node.env.items() if k != "SLURM_JOB_NUM_NODES"}
                              | {"COMERA_DEVICE": "cpu", "COMERA_NPROC_PER_NODE": "8"}, capture_output=True,
                              text=True, check=False)

    r = dry_run("deepspeed.gradient_accumulation_steps=2")
    assert r.returncode == 0, r.stderr
    assert "outside an allocation the job's world size is unknown" in r.stderr and "srun" in r.stdout
    # the config itself is checked there: a mistyped key stops before sbatch's queue wait
    bad = dry_run("deepspeed.gradient_accumulation_step=2")
    assert bad.returncode == 2, bad.stderr
    assert "deepspeed.gradient_accumulation_step" in bad.stderr and "refused this config" in bad.stderr
    assert "srun" not in bad.stdout
