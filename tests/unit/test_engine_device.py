"""``engine/device.py`` and the launchers' accelerator choice (``launch/accelerator.sh``)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

from comera_dist.engine.device import accelerator_device, batches_to_device, collective_tensor, to_device

REPO = Path(__file__).resolve().parents[2]


def test_collective_tensor_is_on_the_accelerator_device():
    t = collective_tensor([1.0, 2.5])
    assert t.device == accelerator_device() and t.dtype == torch.float64 and t.tolist() == [1.0, 2.5]
    assert collective_tensor(3.0).shape == (1,)


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
    r = subprocess.run(["launch/torchrun.sh", "--dry-run", "--config", "x.yaml"], cwd=REPO, env=env,
                       capture_output=True, text=True, check=True)
    assert "--nproc-per-node 4" in r.stdout and "DS_ACCELERATOR=cuda" in r.stderr
