"""``engine/device.py`` and the launchers' accelerator choice (``launch/accelerator.sh``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from comera_dist.engine.device import (
    accelerator_device,
    batches_to_device,
    buffers_to,
    collective_tensor,
    to_device,
)
from comera_dist.layers import TTLinear

REPO = Path(__file__).resolve().parents[2]


def test_collective_tensor_is_on_the_accelerator_device():
    t = collective_tensor([1.0, 2.5])
    assert t.device == accelerator_device() and t.dtype == torch.float64 and t.tolist() == [1.0, 2.5]
    assert collective_tensor(3.0).shape == (1,)


def test_buffers_to_moves_every_buffer_and_leaves_the_parameters():
    # ZeRO-3's zero.Init(module=...) moves only the parameters; the TT layers' tau must follow them
    model = torch.nn.Sequential(TTLinear(16, 16, num_cores=2, max_rank=4), torch.nn.BatchNorm1d(16))
    model[1].register_buffer("scratch", torch.zeros(2), persistent=False)
    keys = set(model.state_dict())
    assert buffers_to(model, "meta") is model
    # tau and bond_sizes (TTLinear), BatchNorm's three, scratch
    assert {b.device.type for b in model.buffers()} == {"meta"} and len(list(model.buffers())) == 6
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert set(model.state_dict()) == keys  # persistence kept: "scratch" stays out of the state dict


def test_to_device_moves_tensors_and_passes_other_values():
    batch = {"input_ids": torch.arange(6).view(2, 3), "labels": torch.zeros(2, 3, dtype=torch.long), "n": 7}
    out = to_device(batch, "cpu")
    assert out["n"] == 7 and set(out) == set(batch)
    assert all(out[k].device == torch.device("cpu") and torch.equal(out[k], batch[k]) for k in ("input_ids", "labels"))
    assert [b["input_ids"].tolist() for b in batches_to_device([batch, batch], "cpu")] == [[[0, 1, 2], [3, 4, 5]]] * 2


def _pick(tmp_path: Path, gpus: int, **env: str) -> tuple[str, str]:
    """Source launch/accelerator.sh with a fake nvidia-smi listing ``gpus`` GPUs."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    smi = bindir / "nvidia-smi"
    smi.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i})'\n" for i in range(gpus)))
    smi.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "COMERA_DEVICE")}
    base["PATH"] = f"{bindir}:{base['PATH']}"
    r = subprocess.run(["bash", "-c", ". launch/accelerator.sh; echo $DS_ACCELERATOR $COMERA_LOCAL_GPUS"],
                       cwd=REPO, env={**base, **env}, capture_output=True, text=True, check=True)
    return tuple(r.stdout.split())


def test_launchers_pick_cuda_on_a_gpu_node_and_cpu_otherwise(tmp_path):
    assert _pick(tmp_path, 2) == ("cuda", "2")
    assert _pick(tmp_path, 0) == ("cpu", "0")
    assert _pick(tmp_path, 2, DS_ACCELERATOR="cpu") == ("cpu", "0")  # asked for: a CPU run on a GPU node
    assert _pick(tmp_path, 2, COMERA_DEVICE="cpu") == ("cpu", "0")


def test_torchrun_defaults_to_one_process_per_gpu(tmp_path):
    bindir = tmp_path / "bin"
    _pick(tmp_path, 4)  # writes the fake nvidia-smi
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "NPROC")}
    env["PATH"] = f"{bindir}:{env['PATH']}"
    # a config the trainer's check (its dry run at 4 ranks) accepts, writing nowhere in the repository
    args = ["--config", "configs/tiny-cpu.yaml", "--set", f"train.output_dir={tmp_path / 'run'}"]
    r = subprocess.run(["launch/torchrun.sh", "--dry-run", *args], cwd=REPO, env=env,
                       capture_output=True, text=True, check=True)
    assert "--nproc-per-node 4" in r.stdout and "DS_ACCELERATOR=cuda" in r.stderr


def _wheel(path: Path, name: str, version: str) -> None:
    import zipfile

    dist = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(path / f"{name}-{version}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}/__init__.py", "VALUE = 42\n")
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", f"{name}/__init__.py,,\n{dist}/METADATA,,\n{dist}/WHEEL,,\n{dist}/RECORD,,\n")


def test_gpu_check_installs_only_missing_wheels_offline(tmp_path):
    wheels, site = tmp_path / "whl", tmp_path / "site"
    wheels.mkdir()
    _wheel(wheels, "comera_probe", "1.0")
    _wheel(wheels, "torch", "0.0.1")  # installed (newer): must be kept, never shadowed
    r = subprocess.run([sys.executable, "launch/gpu_check.py", "install", str(wheels), str(site)], cwd=REPO,
                       capture_output=True, text=True, check=True)
    assert (site / "comera_probe" / "__init__.py").exists() and not (site / "torch").exists(), r.stdout
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", "import comera_probe, galore_torch; print(comera_probe.VALUE)"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "42"  # and galore_torch imports (real or stub bitsandbytes)


def test_gpu_check_resume_comparison_fails_on_a_diverging_run(tmp_path):
    def log(path, losses, extra=""):
        path.write_text(extra + "".join(f"x INFO step {s}/4 train_loss {v} stage 1\n" for s, v in losses.items()))

    run = tmp_path / "a"
    (run / "checkpoints" / "step00000002").mkdir(parents=True)
    (run / "checkpoints" / "step00000002" / "comera_meta.json").write_text(json.dumps({"plans": ["{}"]}))
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    log(a, {1: 6.0, 2: 5.9, 3: 5.8, 4: 5.7}, "step 2: physical prune, engine rebuilt\n")
    cmd = [sys.executable, "launch/gpu_check.py", "resume", str(a), str(b), str(run), "2", "4", "1e-6"]
    log(b, {3: 5.8, 4: 5.7}, "resumed at step 2\n")
    assert subprocess.run(cmd, cwd=REPO, capture_output=True, check=False).returncode == 0
    log(b, {3: 5.8, 4: 5.75}, "resumed at step 2\n")  # diverges at step 4
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    assert r.returncode == 1 and "step 4" in r.stderr
    log(b, {3: 5.8, 4: 5.7})  # never resumed: a fresh run that happens to match is not a resume
    assert subprocess.run(cmd, cwd=REPO, capture_output=True, check=False).returncode == 1
    log(a, {1: 6.0, 2: 5.9, 3: 6.238, 4: 6.238}, "step 2: physical prune, engine rebuilt\n")  # a model that stopped
    log(b, {3: 6.238, 4: 6.238}, "resumed at step 2\n")  # learning matches any resume
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=False)
    assert r.returncode == 1 and "the model no longer trains" in r.stderr, r.stderr


def test_gpu_check_summary_reports_the_cudagraph_trees(tmp_path):
    """A compiled trainer-rate JSON's CUDA-graph tree counts (``bench.compile_stats``) reach
    ``summary.json`` and the printed summary; runs off CUDA (both phases null) are left out."""
    (tmp_path / "results.tsv").write_text("trainer-rate\t0\t1.0\tlogs/a.log\ntrainer-rate-graphs\t0\t2.0\tlogs/b.log\n")
    counts = {"functions": 3, "recorded_graphs": 9, "rerecords": 0, "new_recordings": 6,
              "warmed_up_functions": 3, "stuck_warming_up": 1}
    for name, trees in (("trainer-rate", {"trainer": None, "session": None}),
                        ("trainer-rate-graphs", {"trainer": counts, "session": None})):
        (tmp_path / f"{name}.json").write_text(json.dumps({"metrics": {"trainer_tokens_per_s": 1.0},
                                                           "config": {"cudagraph_trees": trees}}))
    r = subprocess.run([sys.executable, "launch/gpu_check.py", "summary", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["cudagraph_trees"] == {"trainer-rate-graphs": {"trainer": counts, "session": None}}
    assert '"recorded_graphs": 9' in r.stdout and "trainer-rate-graphs cudagraph_trees" in r.stdout
