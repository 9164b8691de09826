"""Shared benchmark plumbing: timing, the machine description, the table and the JSON result."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from comera_dist.configbase import nearest_existing

CUBLAS_WORKSPACE_ENV = ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")
"""cuBLAS sizes its per-stream workspaces from these when it makes them (unset: torch's default)."""
CUBLASLT_ENV = ("DISABLE_ADDMM_CUDA_LT", "TORCH_BLAS_PREFER_CUBLASLT")
"""torch's switches for cuBLASLt: ``addmm`` with a bias (``F.linear``'s, the TT layers' output GEMM) goes to
cuBLASLt's bias epilogue unless the first is 1; the second prefers cuBLASLt for plain products."""
COMMAND_ENV = ("OMP_NUM_THREADS", "COMERA_KERNELS", "COMERA_RANK_ALIGN", "COMERA_FFN_ROWS", "COMERA_COMPILE_BACKEND",
               "TRITON_INTERPRET", "PYTORCH_CUDA_ALLOC_CONF", *CUBLAS_WORKSPACE_ENV, *CUBLASLT_ENV)
"""Environment variables that change what a benchmark runs or measures (threads, kernel backend, CoMERA's rank
padding and fused FFN, the compile backend, the allocator, cuBLAS): ``bench_command`` carries the ones set."""


def base_parser(name: str, description: str) -> argparse.ArgumentParser:
    """The options every benchmark takes: ``--json PATH``, ``--steps N``, ``--batch-size B``."""
    p = argparse.ArgumentParser(prog=f"python -m comera_dist.bench {name}", description=description)
    p.add_argument("--json", type=output_file, help="write the result (metrics, rows, machine) to this JSON file")
    p.add_argument("--steps", type=int, default=None, help="timed repetitions per contender")
    p.add_argument("--batch-size", type=int, default=None, help="override the benchmark's batch size")
    return p


def output_file(text: str) -> Path:
    """An output file option (``--json PATH``), checked when parsed, before minutes of measuring: a usage error
    (exit 2) when it is a directory or lies under a file (it failed at the write, with a traceback, the results
    lost). Missing directories are made at the write."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path} is a directory; give a file path")
    at = nearest_existing(path.parent)
    if not at.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: {at} is a file, not a directory")
    return path


def device_option(text: str) -> str:
    """A ``--device`` value: ``cpu``, ``cuda`` or ``cuda:N``, checked when parsed (a usage error, exit 2).
    Returned as given. Whether the device is here is ``require_device``'s to say: ``bench summary`` parses the
    commands of results from other machines."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: the benchmarks run on cpu, cuda or cuda:N")
    return text


def require_device(p: argparse.ArgumentParser, text: str) -> torch.device:
    """The device ``text`` names, or a usage error (exit 2) when this machine has not got it: a ``cuda`` on a
    CPU-only torch crashed in the first CUDA call."""
    device = torch.device(text)
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            p.error(f"--device {text}: no CUDA device is visible (torch {torch.__version__})")
        if device.index is not None and device.index >= count:
            p.error(f"--device {text}: only {count} CUDA device(s) are visible")
    return device


def workload_options(p: argparse.ArgumentParser, *, smoke_help: str = "tiny model of the same architecture (CI)",
                     threads_help: str = "torch.set_num_threads") -> None:
    """``--smoke`` and ``--threads N``, the options of the benchmarks that build the six-encoder themselves."""
    p.add_argument("--smoke", action="store_true", help=smoke_help)
    p.add_argument("--threads", type=int, default=None, help=threads_help)


def counts(p: argparse.ArgumentParser, args: argparse.Namespace, *, steps: int, batch: int) -> tuple[int, int]:
    """``(--steps, --batch-size)``, each the benchmark's default when not given; a usage error (exit 2)
    naming both when either is below 1."""
    n = steps if args.steps is None else args.steps
    b = batch if args.batch_size is None else args.batch_size
    if n < 1 or b < 1:
        p.error(f"--steps and --batch-size must be >= 1, got {n} and {b}")
    return n, b


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def time_fn(fn: Callable[[], Any], *, warmup: int = 2, reps: int = 5) -> dict[str, float]:
    """Median/min wall time of ``fn()`` in seconds (CUDA-synchronized when on GPU)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "reps": reps}


def print_table(rows: list[dict[str, Any]]) -> None:
    """A plain aligned table of ``rows`` (a column for every key of any row, in the order first seen)."""
    if not rows:
        return
    cols = list(dict.fromkeys(k for r in rows for k in r))  # some rows carry more (an error, counts)
    fmt = [[_fmt(r.get(c, "-")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in fmt)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for row in fmt:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def bench_command(name: str, argv: list[str]) -> str:
    """The command line that reruns benchmark ``name`` with ``argv``: ``python -m comera_dist.bench name argv``,
    after the ``COMMAND_ENV`` variables set in this process (``COMERA_RANK_ALIGN=1 python -m ...``)."""
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in COMMAND_ENV if k in os.environ]
    return " ".join([*env, shlex.join(["python", "-m", "comera_dist.bench", name, *argv])])


def write_result(path: Path | None, name: str, metrics: dict[str, Any], rows: list[dict[str, Any]],
                 config: dict[str, Any] | None = None, *, argv: list[str]) -> dict[str, Any]:
    """Print the table and metrics; write ``{benchmark, machine, config, metrics, rows}`` to ``path``.
    ``argv`` (the benchmark's own arguments) becomes ``config["bench_command"]``, the exact command line
    ``bench summary`` prints for the result."""
    config = {"bench_command": bench_command(name, argv), **(config or {})}
    result = {"benchmark": name, "machine": machine(), "config": config, "metrics": metrics, "rows": rows}
    print_table(rows)
    print(json.dumps({"metrics": metrics}, indent=2))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(path)
    return result


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def single_rank_env() -> None:
    """RANK, WORLD_SIZE, MASTER_ADDR/PORT ... of a 1-process job on a free loopback port, unless a
    launcher already set them: benchmarks that run the real trainer in their own process (``soak``,
    ``trainer-rate``) call ``engine.trainer.train`` as rank 0 of 1."""
    if "RANK" in os.environ:
        return
    from comera_dist.engine.ports import LOOPBACK, free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR=LOOPBACK, MASTER_PORT=str(free_port()))
