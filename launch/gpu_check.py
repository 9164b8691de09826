"""Helpers of launch/gpu_check.sh (stdlib only): install missing wheels, check a resumed run, summarise.

usage: python launch/gpu_check.py install WHEEL_DIR SITE
       python launch/gpu_check.py resume RUN_A_LOG RUN_B_LOG RUN_A_DIR RESUME_STEP LAST_STEP REL_TOL
       python launch/gpu_check.py summary OUTDIR
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

# galore_torch/__init__.py imports bitsandbytes for its 8-bit optimizer; the GPU machine lacks it and
# its wheel is too large to carry. GaLoreAdamW (what the benchmarks use) needs none of it.
BNB_STUB = {
    "bitsandbytes/__init__.py": '"""Stub (launch/gpu_check.py): only lets galore_torch import."""\n',
    "bitsandbytes/optim/__init__.py": "",
    "bitsandbytes/optim/optimizer.py": (
        "class Optimizer2State:  # stub: galore_torch's AdamW8bit subclasses it; never instantiated here\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        raise RuntimeError('bitsandbytes is a stub on this machine (launch/gpu_check.py)')\n"),
}


def _version_key(v: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"[.+-]", v))


def _wheel_name_version(path: Path) -> tuple[str, str]:
    name, version = path.name.split("-")[:2]
    return name.replace("_", "-").lower(), version


def install(wheel_dir: str, site: str) -> int:
    """Install each wheel whose distribution is missing or older than the wheel, into ``site``."""
    wheels = sorted(Path(wheel_dir).glob("*.whl"))
    todo = []
    for w in wheels:
        name, version = _wheel_name_version(w)
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have is None or _version_key(have) < _version_key(version):
            todo.append(w)
        print(f"  {name:20s} have {have or '-':12s} wheel {version:12s} {'install' if w in todo else 'keep'}")
    if todo:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", site,
               *map(str, todo)]
        print("  " + " ".join(cmd))
        subprocess.run(cmd, check=True)
    try:
        metadata.version("bitsandbytes")
    except metadata.PackageNotFoundError:
        for rel, text in BNB_STUB.items():
            path = Path(site) / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        print(f"  bitsandbytes stub written to {site}")
    for w in todo:  # a wheel that does not unpack cleanly shows up here, not as an import error later
        zipfile.ZipFile(w).testzip()
    return 0


STEP_LINE = re.compile(r"step (\d+)/(\d+) (.*)$")


def _train_losses(log: Path) -> dict[int, float]:
    out = {}
    for line in log.read_text(errors="replace").splitlines():
        m = STEP_LINE.search(line)
        if m:
            fields = m.group(3).split()
            values = dict(zip(fields[::2], fields[1::2]))
            if "train_loss" in values:
                out[int(m.group(1))] = float(values["train_loss"])
    return out


def resume(log_a: str, log_b: str, dir_a: str, resume_step: str, last_step: str, rel_tol: str) -> int:
    """Run B resumed run A's checkpoint at ``resume_step``: its losses must be A's, step for step. A's losses must
    move after that step: a model that no longer trains (a dead input embedding pins the loss at ln(vocab)) would
    pass the comparison whatever the resume restored."""
    k, last, tol = int(resume_step), int(last_step), float(rel_tol)
    a, b = _train_losses(Path(log_a)), _train_losses(Path(log_b))
    text_a, text_b = Path(log_a).read_text(errors="replace"), Path(log_b).read_text(errors="replace")
    problems = []
    if f"resumed at step {k}" not in text_b:
        problems.append(f"run B never logged 'resumed at step {k}'")
    if "physical prune, engine rebuilt" not in text_a:
        problems.append("run A never pruned (no 'physical prune, engine rebuilt' line)")
    metas = {int(p.parent.name[4:]): json.loads(p.read_text())
             for p in Path(dir_a).glob("checkpoints/step*/comera_meta.json")}
    if k not in metas:
        problems.append(f"run A wrote no complete checkpoint at step {k}")
    if not any(m.get("plans") for m in metas.values()):
        problems.append("no checkpoint of run A carries a pruning plan")
    resumed_pruned = bool(metas.get(k, {}).get("plans"))
    steps = range(k + 1, last + 1)
    missing = [s for s in steps if s not in a or s not in b]
    if missing:
        problems.append(f"steps {missing} missing from the logs (log_every must be 1)")
    compared = [a[s] for s in steps if s in a]
    if len(compared) > 1 and len(set(compared)) == 1:
        problems.append(f"run A's loss is {compared[0]} at every step after {k}: the model no longer trains, so "
                        "matching it proves nothing about the resume")
    worst = 0.0
    for s in steps:
        if s in a and s in b:
            rel = abs(a[s] - b[s]) / max(abs(a[s]), 1e-12)
            worst = max(worst, rel)
            if not (math.isfinite(b[s]) and rel <= tol):
                problems.append(f"step {s}: run A loss {a[s]}, resumed run B loss {b[s]} (rel diff {rel:.2e} > {tol})")
    print(json.dumps({"resume_step": k, "resumed_a_pruned_model": resumed_pruned, "last_step": last,
                      "compared_steps": len(steps),
                      "max_rel_diff": worst, "problems": problems}))
    for p in problems:
        print("FAIL:", p, file=sys.stderr)
    return 1 if problems else 0


HEADLINE_FILES = ("kernels", "six-encoder", "six-encoder-ws4", "six-encoder-compiled", "six-encoder-recompute",
                  "six-encoder-recompute-factors",
                  "six-encoder-align1", "six-encoder-nolt", "six-encoder-ffn-off", "six-encoder-peaks",
                  "trainer-rate", "trainer-rate-unpacked", "trainer-rate-nocheck", "trainer-rate-lean", "trainer-rate-graphs",
                  "trainer-rate-graphs-opt")
"""The benchmark JSONs whose metrics the summary prints (what the GPU figures in docs/ come from)."""


HOST_PHASES = {  # label -> the function (bench.host_profile's naming) whose cumulative time is that phase
    "step": r"comera_dist/(engine/session|bench/six_encoder)\.py:\d+\(train_step\)",
    "model forward": r"comera_dist/models/\w+\.py:\d+\(forward\)",  # the outermost model's, first by time
    "deepspeed forward": r"deepspeed/runtime/engine\.py:\d+\(forward\)",
    "deepspeed backward": r"deepspeed/runtime/engine\.py:\d+\(backward\)",
    "autograd backward": r"torch/autograd/__init__\.py:\d+\(backward\)",
    "deepspeed backward epilogue": r"deepspeed/runtime/engine\.py:\d+\(_backward_epilogue\)",
    "deepspeed step": r"deepspeed/runtime/engine\.py:\d+\(step\)",
    "zero grad norm": r"deepspeed/runtime/zero/stage_1_and_2\.py:\d+\(scaled_global_norm\)",
    "all_reduce": r"torch/distributed/distributed_c10d\.py:\d+\(all_reduce\)",
    "torch optimizer": r"torch/optim/optimizer\.py:\d+\(wrapper\)",
    "session reads": r"comera_dist/engine/session\.py:\d+\(_after_step\)",
    # the trainer loop's own work around the session step (its "trainer loop" profile)
    "batch fetch": r"comera_dist/engine/run_data\.py:\d+\(next_train_batches\)",
    "device synchronize": r"deepspeed/accelerator/\w+_accelerator\.py:\d+\(synchronize\)",
    "step metrics": r"comera_dist/engine/trainer\.py:\d+\(_step_metrics\)",
    "metrics log": r"comera_dist/metrics/core\.py:\d+\(log\)",
}
"""The phases of a bare or session step that the summary prints from its cumulative host profile, so a GPU
run says at a glance whether DeepSpeed's forward, backward or step holds the trainer's host time."""


def _host_phases(profile: dict) -> dict[str, float]:
    """A trainer-rate ``host_profile`` -> ``{phase: ms per step}`` for each ``HOST_PHASES`` entry found among
    its cumulative rows (the first match: the rows are sorted by cumulative time)."""
    phases = {}
    rows = profile["by_cumulative"] + profile.get("root_rows", [])  # the trainer loop's own calls too
    for label, pattern in HOST_PHASES.items():
        row = next((r for r in rows if re.fullmatch(pattern, r["function"])), None)
        if row is not None:
            phases[label] = 1e3 * row["cum_s"]
    return phases


def summary(outdir: str) -> int:
    """``results.tsv`` (name, rc, seconds, log) -> ``summary.json`` and a table; 1 if any step failed."""
    out = Path(outdir)
    rows = []
    for line in (out / "results.tsv").read_text().splitlines():
        name, rc, seconds, log = line.split("\t")
        rows.append({"step": name, "rc": int(rc), "seconds": float(seconds), "log": log,
                     "status": "pass" if rc == "0" else ("timeout" if rc in ("124", "137") else "FAIL")})
    env = json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else {}
    ok = all(r["rc"] == 0 for r in rows)
    results = {name: json.loads((out / f"{name}.json").read_text())
               for name in HEADLINE_FILES if (out / f"{name}.json").exists()}
    figures = {name: r.get("metrics", {}) for name, r in results.items()}
    # whether a compiled trainer's CUDA graphs replayed as recorded (bench.compile_stats; null off CUDA)
    trees = {name: t for name, r in results.items()
             if (t := (r.get("config") or {}).get("cudagraph_trees")) and any(t.values())}
    # where each profiled step's device time went (bench six-encoder --profile; bench.kernel_time)
    kernel_ms = {f"{name} {row}": k for name, r in results.items()
                 for row, k in ((r.get("config") or {}).get("kernel_time") or {}).items() if "device_ms" in k}
    # where each trainer-rate step's host time went, by phase (bench.host_profile's cumulative view)
    host = {f"{name} {step}": _host_phases(p) for name, r in results.items()
            for step, p in ((r.get("config") or {}).get("host_profile") or {}).items() if "by_cumulative" in p}
    # what each eager batch-1 step holds at its peak, by the line that allocated it (bench.peak_allocations)
    peaks = {f"{name} {row}": p for name, r in results.items()
             for row, p in ((r.get("config") or {}).get("peak_allocations") or {}).items()}
    result = {"ok": ok, "env": env, "steps": rows, "total_seconds": sum(r["seconds"] for r in rows),
              "metrics": figures, "cudagraph_trees": trees, "kernel_time": kernel_ms, "host_phases_ms": host,
              "peak_allocations": peaks}
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\ngpu_check summary ({env.get('device', '?')}, mode {env.get('mode', '?')}):")
    for r in rows:
        print(f"  {r['status']:8s} {r['seconds']:7.1f} s  {r['step']:28s} {r['log']}")
    for name, metrics in figures.items():  # the measured figures, e.g. trainer and bench step rates side by side
        print(f"  {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float))))
    for name, per_phase in trees.items():
        print(f"  {name} cudagraph_trees: " + json.dumps(per_phase))
    for name, k in kernel_ms.items():
        print(f"  {name}: kernels {k['device_ms']:.2f} ms (" +
              ", ".join(f"{kind} {ms:.2f}" for kind, ms in k["by_kind_ms"].items()) + ")")
    for name, phases in host.items():
        print(f"  {name} host ms/step (cProfile): " + ", ".join(f"{f} {ms:.2f}" for f, ms in phases.items()))
    for name, p in peaks.items():
        if "rows" not in p:
            print(f"  {name} peak allocations: {p.get('skipped') or p.get('error')}")
            continue
        head = (f"{p['before_MiB']:.1f} MiB before the step, {p['transient_peak_MiB']:.1f} MiB more at its peak as "
                f"asked for ({p['peak_allocated_MiB']:.1f} in the allocator's blocks)" if "before_MiB" in p else
                f"{p['transient_peak_MiB']:.1f} MiB allocated in the step at its peak ({p.get('recorded_by')})")
        print(f"  {name} peak allocations: {head}: " + ", ".join(f"{r['where']} {r['MiB']:.2f}" for r in p["rows"][:8]))
    print(f"  {'PASS' if ok else 'FAIL'}: {sum(r['rc'] == 0 for r in rows)}/{len(rows)} steps, "
          f"{result['total_seconds']:.0f} s; details in {out}/summary.json")
    return 0 if ok else 1


def env_info(outdir: str, mode: str) -> int:
    """``env.json``: the machine and the versions the check ran with."""
    info: dict[str, object] = {"mode": mode, "python": sys.version.split()[0]}
    try:
        import torch

        info["torch"] = torch.__version__
        info["cuda"] = torch.version.cuda
        info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        info["gpus"] = torch.cuda.device_count()
    except Exception as e:  # noqa: BLE001 - the summary still names what is broken
        info["torch_error"] = repr(e)
    for name in ("deepspeed", "triton", "transformers", "datasets", "galore-torch"):
        try:
            info[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            info[name] = None
    for module in ("deepspeed", "datasets", "galore_torch"):
        try:
            __import__(module)
        except Exception as e:  # noqa: BLE001 - any import failure is what the env step reports
            info.setdefault("import_errors", {})[module] = repr(e)[:300]
    Path(outdir, "env.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info))
    return 1 if "import_errors" in info or "torch_error" in info else 0


if __name__ == "__main__":
    commands = {"install": install, "resume": resume, "summary": summary, "env": env_info}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(commands[sys.argv[1]](*sys.argv[2:]))
