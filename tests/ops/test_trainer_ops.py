"""The real training job under real Slurm and Prometheus: sbatch slurm/pretrain.sh configs/tiny-cpu.yaml.

1 node (with Prometheus scraping the job through the discovery file it writes),
a USR1 preemption with requeue and resume, and 2 emulated nodes.
"""

from __future__ import annotations

import json
import math
import re
import time

import promserver
import pytest
from check_dashboard import DASHBOARD, expressions
from opsmarks import REPO, requires_prometheus, requires_slurm
from slurmharness import cpu_overrides, free_port_block

pytestmark = [pytest.mark.slow, pytest.mark.distributed, requires_slurm]
CONFIG = "configs/tiny-cpu.yaml"
STEPS = 40  # a few seconds at tiny-cpu's pace: the job itself waits for a scrape before and after them


def _submit(cluster, tmp_path, *overrides: str, nodes: int = 1, nproc: int = 2):
    log = tmp_path / "job.out"
    job = cluster.sbatch(f"--nodes={nodes}",
                         *cpu_overrides(log, COMERA_NPROC_PER_NODE=str(nproc), COMERA_RDZV_PORT=str(free_port_block(1))),
                         REPO / "slurm/pretrain.sh", CONFIG, "--set", f"train.output_dir={tmp_path / 'run'}",
                         "--set", "metrics.progress=false", *overrides)
    return job, log


def _steps(text: str, total: int) -> list[int]:
    return [int(s) for s in re.findall(rf"\] INFO comera_dist\.engine\.trainer: step (\d+)/{total} ", text)]


@requires_prometheus
def test_sbatch_tiny_cpu_scraped_by_prometheus(slurm_1node, tmp_path):
    port = free_port_block(1)
    sd_file = tmp_path / "targets.json"
    promserver.up(tmp_path / "prom", port, sd_file)
    try:
        start = time.time()
        # rate()-based dashboard panels need a sample before the steps and one after them: the job
        # waits for both (first/final_scrape_timeout_s), however fast this machine trains (a CI run
        # once trained all STEPS before its target was discovered: "no data" for the step time).
        job, log = _submit(slurm_1node, tmp_path, "--set", f"train.steps={STEPS}",
                           "--set", f"train.eval_every={STEPS // 2}", "--set", f"train.checkpoint_every={STEPS // 2}",
                           "--set", f"metrics.sd_file={sd_file}",
                           "--set", "metrics.compression_target=2.0",
                           # the run lasts seconds: without it the final values (last step, its checkpoint)
                           # may never be scraped (file_sd changes reach the scrapers every 5 s)
                           "--set", "metrics.first_scrape_timeout_s=30",
                           "--set", "metrics.final_scrape_timeout_s=30")
        info = slurm_1node.wait(job, timeout=400)
        end = time.time()
        text = log.read_text()
        assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), text
        assert _steps(text, STEPS) == list(range(STEPS + 1)), text  # step 0: the initial evaluation
        ckpts = tmp_path / "run/checkpoints"
        assert (ckpts / "latest").read_text().strip() == f"step{STEPS:08d}"
        assert json.loads(sd_file.read_text()) == []  # target withdrawn at exit
        assert "no scrape of the final values" not in text and "no scrape of the starting values" not in text

        def series(expr):  # the job's whole life: its exporter is gone now
            return promserver.query_range(port, expr, start, end, step=0.5)

        # compression ratio: the value the trainer printed at its last step
        (step,) = series("comera_train_step")
        assert float(step["values"][-1][1]) == STEPS  # the final values were scraped
        (ratio,) = series('comera_compression_ratio{job="comera",run="run"}')
        printed = float(re.findall(rf"step {STEPS}/{STEPS} .*compression_ratio ([\d.]+)", text)[0])
        assert float(ratio["values"][-1][1]) == pytest.approx(printed, rel=1e-3)
        assert ratio["metric"]["slurm_job_id"] == str(job)
        # ranks: one series per (layer, bond), last values = the final ranks in the job's report
        ranks = {(r["metric"]["layer"], int(r["metric"]["bond"])): int(float(r["values"][-1][1]))
                 for r in series("comera_tt_rank")}
        report = (tmp_path / "run/report.md").read_text()
        final = {layer: json.loads(after) for layer, after in re.findall(r"^\| (\S+) \| \[.*?\] -> (\[.*?\]) \|$",
                                                                           report, re.MULTILINE)}
        assert final and ranks == {(layer, b): r for layer, rs in final.items() for b, r in enumerate(rs)}
        # every dashboard expression had data while the job ran
        for expr in expressions(json.loads(DASHBOARD.read_text()), run="run"):  # the job's run (its output dir)
            points = [float(v) for s in series(expr) for _, v in s["values"]]
            assert any(math.isfinite(v) for v in points), f"no data for {expr}"
    finally:
        promserver.down(tmp_path / "prom")


def test_preemption_checkpoints_requeues_and_resumes(slurm_1node, tmp_path):
    job, log = _submit(slurm_1node, tmp_path, "--set", "train.steps=24", "--set", "train.eval_every=0",
                       "--set", "train.checkpoint_every=0")
    info, text = slurm_1node.usr1_when(log, r"trainer: step 2/24 ", job, timeout=400)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), \
        text + slurm_1node.logs()
    stopped = int(re.search(r"stop requested \(SIGUSR1\): checkpointing at step (\d+)", text).group(1))
    assert 2 <= stopped < 24
    first, second = text.split("pretrain.sh: job", 2)[1:] if text.count("pretrain.sh: job") == 2 else (text, "")
    assert "restart 1 on 1 node(s)" in second, text
    assert _steps(first, 24) == list(range(stopped + 1))
    assert f"resumed at step {stopped}" in second
    assert _steps(second, 24) == list(range(stopped + 1, 25))  # continues the count: no step 0, none repeated
    ckpts = tmp_path / "run/checkpoints"
    assert (ckpts / f"step{stopped:08d}").is_dir() and (ckpts / "latest").read_text().strip() == "step00000024"


def test_a_usr1_at_the_last_step_does_not_requeue_the_finished_run(slurm_1node, tmp_path):
    """Slurm's USR1 at the last step or after it (here while rank 0 waits out its final scrape): the trainers end
    the run at train.steps and exit 0, and pretrain.sh requeued the job, which came back only to say "nothing to
    train". Now it asks the trainer's --check-config --json first."""
    job, log = _submit(slurm_1node, tmp_path, "--set", "train.steps=2", "--set", "train.eval_every=0",
                       "--set", "train.checkpoint_every=0", "--set", f"metrics.sd_file={tmp_path / 'targets.json'}",
                       "--set", "metrics.final_scrape_timeout_s=20")  # no Prometheus: 20 s after the last step
    info, text = slurm_1node.usr1_when(log, r"trainer: step 2/2 ", job, timeout=400)
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), \
        text + slurm_1node.logs()
    assert "pretrain.sh: caught USR1" in text, text  # the signal came while the job ran
    assert f"the run reached train.steps before the USR1 took effect; not requeueing job {job}" in text, text
    assert text.count("pretrain.sh: job") == 1 and "; requeueing job" not in text, text
    time.sleep(3)  # a requeued job would be PENDING again by now
    assert slurm_1node.job(job)["JobState"] == "COMPLETED"
    assert (tmp_path / "run/checkpoints/latest").read_text().strip() == "step00000002"


def test_two_emulated_nodes_train(slurm_2nodes, tmp_path):
    job, log = _submit(slurm_2nodes, tmp_path, "--set", "train.steps=3", "--set", "train.eval_every=0",
                       "--set", "train.checkpoint_every=0", nodes=2, nproc=1)
    info = slurm_2nodes.wait(job, timeout=400)
    text = log.read_text()
    assert (info["JobState"], info["ExitCode"], info["NodeList"]) == ("COMPLETED", "0:0", "n[1-2]"), text
    assert "on 2 node(s) (n[1-2]), head n1=127.0.0.2" in text and "1 process(es)/node" in text
    assert sorted(re.findall(r"rank (\d)/2 up \(local rank 0,", text)) == ["0", "1"], text
    assert _steps(text, 3) == [0, 1, 2, 3]
    assert (tmp_path / "run/checkpoints/latest").read_text().strip() == "step00000003"
