"""``python -m comera_dist.bench summary``: regenerate ``docs/benchmarks.md`` from ``docs/bench/*.json``.

Every number in the page comes from a benchmark's JSON (written by ``--json``): the command that
made it (the ``bench_command`` it recorded, else one rebuilt from its recorded settings, marked so),
the machine it ran on and its load, each row table, each target with the measured value and, for a
missed target, the gap and the profiled cause (the top ``torch.profiler`` ops the benchmark recorded).
Hand-written analysis, if any, lives in ``docs/bench/notes/<benchmark>.md`` and is included
verbatim under its benchmark. Plots are written next to the JSON as ``<benchmark>.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ORDER = ("six-encoder", "galore", "codebert", "prune-payoff", "memory", "comm", "layers", "kernels", "ops",
         "soak")
# benchmark -> [(metric, rule, target, what it compares)]; rule: ">=", "<=" or "within" (lo, hi); a target
# that is a metric's name is that metric of the same run (bench comm: the run's own compression ratio)
TARGETS: dict[str, list[tuple[str, str, Any, str]]] = {
    "six-encoder": [("speedup_vs_dense_b32", ">=", 5.0, "CoMERA step vs dense step, batch 32 (CPU)")],
    "galore": [("speedup_vs_galore_b1", ">=", 6.0, "CoMERA step vs GaLoreAdamW step, batch 1"),
               ("memory_ratio_galore_over_comera_b1", ">=", 10.0, "tensor memory, GaLore / CoMERA, batch 1")],
    "codebert": [("compression_ratio", ">=", 4.23, "whole-model compression at the end of training"),
                 ("val_loss_ratio_comera_over_dense", "<=", 1.03, "final validation MLM loss, CoMERA / dense"),
                 ("epoch_speedup_vs_dense", ">=", 3.0, "training time for the same tokens, dense / CoMERA")],
    "prune-payoff": [("step_time_ratio_over_flop_ratio", "within", (0.8, 1.2),
                      "(step time after / before pruning) / (FLOPs after / before)")],
    "comm": [("comm_bytes_ratio_dense_over_comera", ">=", "compression_ratio",
              "bytes communicated per step, dense / CoMERA, against the whole-model compression ratio")],
    "ops": [("ops_ratio_comera_over_dense", "<=", 2.0, "aten ops per training step, CoMERA / dense (GPU-path proxy)"),
            ("syncs_excess_comera_over_dense", "<=", 0, "host syncs per step, CoMERA minus dense (GPU-path proxy)")],
    "trainer-rate": [("trainer_rate_over_bench", ">=", 0.8, "the trainer's step rate / the bare eager step's"),
                     ("trainer_rate_over_bench_graph", ">=", 0.8,
                      "the trainer's step rate / the bare step's captured in one CUDA graph (GPU)")],
    "soak": [("rss_drift", "within", (-0.05, 0.05), "RSS, median of the last quarter / the first quarter - 1")],
}


def check(rule: str, target: Any, value: float) -> tuple[bool, str]:
    """(met, gap text) of ``value`` against ``target`` under ``rule``."""
    if not math.isfinite(value):
        return False, "not finite"
    if rule == ">=":
        if value <= 0:
            return value >= target, "no gain"
        short = target / value  # a miss by under 1% keeps its size: 3.013 / 3.004 is "1.003x", not "1.00x"
        return value >= target, f"{short:.2f}x short" if short >= 1.01 else f"{short:.4g}x short"
    if rule == "<=":
        return value <= target, f"{value - target:+.3f} over"
    lo, hi = target
    return lo <= value <= hi, f"{min(abs(value - lo), abs(value - hi)):.2f} outside [{lo}, {hi}]"


def _fmt(v: Any) -> str:
    if v is None:  # a row without this value (e.g. bench codebert's CoMERA row has no single lr)
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def md_table(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    cols = list(dict.fromkeys(k for r in rows for k in r))  # some rows carry more (an error, counts)
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(_fmt(r.get(c, "-")) for c in cols) + " |" for r in rows]
    return out


def profile_lines(profile: dict[str, list[dict[str, Any]]] | None) -> list[str]:
    """Top ops per contender, as recorded by the benchmark."""
    if not profile:
        return ["(this result carries no profile)"]
    out = []
    for who, ops in profile.items():
        if not ops:
            continue
        top = "; ".join(f"`{o['op']}` {100 * o['share']:.0f}% ({o['calls']} calls, "
                        f"{1e3 * o['self_cpu_s'] / max(o['calls'], 1):.2f} ms/call)" for o in ops[:5])
        out.append(f"- {who}: {top}")
    return out


def plot(name: str, result: dict[str, Any], out: Path, *, title: str | None = None) -> bool:
    """Write ``out`` (a PNG) for the benchmarks that have a natural picture; False if none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cfg = result["rows"], result["config"]
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    if name == "six-encoder":
        # one line per contender (and per mode and dtype, for device runs that record them)
        series = sorted({(r["contender"], r.get("mode", ""), r.get("dtype", "")) for r in rows if "step_s" in r})
        for who, mode, dtype in series:
            pts = sorted((r["batch"], r["step_s"]) for r in rows if "step_s" in r and
                         (r["contender"], r.get("mode", ""), r.get("dtype", "")) == (who, mode, dtype))
            ax.plot(*zip(*pts), marker="o", label=" ".join(x for x in (who, mode, dtype) if x))
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="s / step (fwd+bwd+AdamW)")
    elif name in ("galore", "memory"):
        roles = ["params", "grads", "optimizer", "activations"]
        bottom = [0.0] * len(rows)
        for role in roles:
            vals = [r[f"{role}_MiB"] for r in rows]
            ax.bar([r["contender"] for r in rows], vals, bottom=bottom, label=role)
            bottom = [b + v for b, v in zip(bottom, vals)]
        if all("peak_MiB" in r for r in rows):  # what was alive at once, recomputed activations included
            ax.scatter([r["contender"] for r in rows], [r["peak_MiB"] for r in rows], color="black", marker="_",
                       s=900, zorder=3, label="step peak")
        ax.set(ylabel="MiB (measured tensors)")
    elif name == "codebert":
        for who, curve in cfg.get("curves", {}).items():
            ax.plot([p["step"] for p in curve], [p["val_loss"] for p in curve], marker=".", label=who)
        ax.set(xlabel="step (equal tokens per step)", ylabel="validation MLM loss")
    elif name == "prune-payoff":
        base = rows[0]
        ax.bar(["step time", "FLOPs"], [rows[1]["step_s"] / base["step_s"], rows[1]["step_gflop"] / base["step_gflop"]])
        ax.axhline(1.0, color="gray", lw=0.5)
        ax.set(ylabel="pruned / masked")
    else:
        plt.close(fig)
        return False
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    ax.set_title(title or name)
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return True


def machine_line(m: dict[str, Any]) -> str:
    """The machine of a result (its JSON's ``machine``) in words: device, CPU and cores, torch, Python."""
    device = f"GPU {m['gpu']}" if m.get("gpu") else "CPU only"
    return (f"{device}; {m.get('cpu') or 'CPU unknown'}, {m.get('cpu_count') or 'unknown'} cores; "
            f"torch {m.get('torch', 'unknown')}, Python {m.get('python', 'unknown')}")


def section(name: str, result: dict[str, Any], bench_dir: Path, doc_dir: Path) -> list[str]:
    """The page section of the result in ``<name>.json`` (targets and plot by its ``benchmark``)."""
    cfg, metrics, kind = result["config"], result["metrics"], result["benchmark"]
    lines = [f"## {name}", ""]
    load = (cfg.get("load_avg_start"), cfg.get("load_avg_end"))
    run = {k: v for k, v in cfg.items() if k in ("steps", "batch_size", "batch_sizes", "seq_len", "threads",
                                                  "smoke", "keep", "loop", "galore", "config", "overrides", "recompute",
                                                  "recompute_factors",
                                                  "schedule_scale", "dense_lrs", "dense_lr")}
    lines += [f"Run settings: `{json.dumps(run)}`.", ""]
    machine = result.get("machine", {})
    if all(load):
        cores = machine.get("cpu_count") or "unknown"
        lines += [f"1-min load average at start / end: {load[0][0]:.1f} / {load[1][0]:.1f} ({cores} cores).", ""]
    lines += [f"Machine: {machine_line(machine)}.", ""]
    own = cfg.get("target") if isinstance(cfg.get("target"), dict) else {}
    # A run that records its own thresholds (e.g. ``bench codebert --target-ratio``) is judged by them.
    targets = [(m, rule, own.get(m, target), what) for m, rule, target, what in TARGETS.get(kind, [])
               if m in metrics or m in own or not own]  # a run with its own targets (a GPU run) is judged by those
    known = {m for m, *_ in targets}
    targets += [(m, ">=", t, "target recorded by the run") for m, t in own.items()
                if m not in known and isinstance(t, (int, float)) and m in metrics]
    missed = []
    if targets:
        lines += ["| metric | compares | target | measured | status |", "|---|---|---|---|---|"]
        for metric, rule, target, what in targets:
            value, shown = metrics.get(metric), _fmt(target)
            if isinstance(target, str):  # another metric of this run is the threshold
                shown = f"`{target}`" + (f" = {_fmt(float(metrics[target]))}" if target in metrics else "")
                target = metrics.get(target)
            if value is None or target is None:
                lines.append(f"| `{metric}` | {what} | {rule} {shown} | {'missing' if value is None else _fmt(value)}"
                             " | not measured |")
                continue
            met, gap = check(rule, target, float(value))
            lines.append(f"| `{metric}` | {what} | {rule} {shown} | {_fmt(float(value))} | "
                         f"{'met' if met else 'MISSED (' + gap + ')'} |")
            if not met:
                missed.append(metric)
        lines.append("")
    lines += ["All metrics: " + ", ".join(f"`{k}` = {_fmt(v)}" for k, v in metrics.items()), ""]
    lines += md_table(result["rows"]) + [""]
    png = bench_dir / f"{name}.png"
    if plot(kind, result, png, title=name):
        lines += [f"![{name}]({Path(os.path.relpath(png, doc_dir)).as_posix()})", ""]
    if missed or cfg.get("profile"):
        head = "Profiled cause of the miss" if missed else "Profile"
        lines += [f"{head} (top ops by self CPU time, one step each, from this run):", ""]
        lines += profile_lines(cfg.get("profile")) + [""]
    note = bench_dir / "notes" / f"{name}.md"
    if note.is_file():
        lines += [note.read_text().strip(), ""]
    return lines


REBUILT = "(rebuilt from the recorded settings)"
"""The note after a command that the run did not record itself (a JSON from before ``bench_command``)."""
FLAGS = {  # benchmark -> [(config key, flag)] of the scalar settings it records under their own names
    "six-encoder": [("steps", "--steps"), ("threads", "--threads")],
    "galore": [("steps", "--steps"), ("batch_size", "--batch-size"), ("threads", "--threads")],
    "memory": [("steps", "--steps"), ("batch_size", "--batch-size"), ("threads", "--threads")],
    "prune-payoff": [("steps", "--steps"), ("batch_size", "--batch-size"), ("keep", "--keep"), ("threads", "--threads")],
    "codebert": [("steps", "--steps"), ("batch_size", "--batch-size"), ("eval_every", "--eval-every"),
                 ("eval_batches", "--eval-batches"), ("threads", "--threads")],
    "comm": [("steps", "--steps"), ("micro_batch", "--batch-size"), ("zero_stage", "--zero-stage"),
             ("warmup", "--warmup")],
    "layers": [("reps", "--steps"), ("tokens", "--batch-size")],
    "kernels": [("reps", "--steps")],
    "ops": [("batch_size", "--batch-size")],
    "soak": [("steps", "--steps"), ("checkpoint_every", "--checkpoint-every")],
    "trainer-rate": [("config", "--config"), ("bench_steps", "--steps"), ("trainer_skipped_steps", "--skip"),
                     ("bench_warmup", "--warmup")],
}


def _seen(rows: list[dict[str, Any]], key: str) -> list[Any]:
    """The values of ``key`` in ``rows``, each once, in the order the run made them."""
    return list(dict.fromkeys(r[key] for r in rows if key in r))


def rebuilt_command(name: str, result: dict[str, Any], stem: str | None = None) -> list[str]:
    """The environment and arguments of the command that reruns ``result`` as its JSON records it: every
    recorded setting that changes the run, leaving out the defaults. For the runs from before each
    benchmark recorded its own ``bench_command``."""
    cfg, rows, metrics = result["config"], result["rows"], result["metrics"]
    env: list[str] = []
    args = ["--json", f"docs/bench/{stem or name}.json"]
    for key, flag in FLAGS.get(name, []):
        if isinstance(cfg.get(key), (int, float, str)):  # a per-policy mapping (bench ops' threads) is no flag
            args += [flag, str(cfg[key])]
    if name == "six-encoder":
        if "device" in cfg:  # the device comparison (six_encoder_device): its name for a GPU
            device = "cpu" if cfg["device"] == "cpu" else "cuda"
            args += ["--device", device]
            for key, flag, default in (("mode", "--modes", {"eager", "graph"} if device == "cuda" else {"eager"}),
                                       ("dtype", "--dtypes", {"fp32", "bf16"}),
                                       ("contender", "--contenders", {"dense", "comera", "galore"})):
                if set(_seen(rows, key)) != default:
                    args += [flag, *_seen(rows, key)]
            backend = re.search(r"backend='([^']+)'", cfg.get("modes", ""))
            if backend and backend[1] != "inductor" and any(m.startswith("compiled") for m in _seen(rows, "mode")):
                args += ["--compile-backend", backend[1]]
            args += ["--profile"] if cfg.get("kernel_time") else []
        args += ["--batch-sizes", *map(str, cfg.get("batch_sizes", []))]
        from comera_dist.kernels.dispatch import RANK_ALIGN  # the default of COMERA_RANK_ALIGN

        if cfg.get("rank_align", RANK_ALIGN) != RANK_ALIGN:
            env.append(f"COMERA_RANK_ALIGN={cfg['rank_align']}")
        if cfg.get("ffn_rows", "auto") != "auto":
            env.append(f"COMERA_FFN_ROWS={cfg['ffn_rows']}")
        cublas = (cfg.get("cublas_workspace_env") or {}) | (cfg.get("cublaslt_env") or {})  # device runs
        env += [f"{k}={v}" for k, v in cublas.items() if v is not None]
    elif name == "layers" and "malloc_tuned" in _seen(rows, "allocator"):
        args.append("--malloc-tune")
    elif name == "kernels":
        on_cpu = str(cfg.get("device", "")).startswith("cpu")  # the Triton interpreter's smoke run
        args += ["--tokens", *map(str, cfg.get("tokens", []))]
        dtypes = cfg.get("dtypes") or []
        if dtypes and dtypes != (["fp32"] if on_cpu else ["fp32", "bf16"]):
            args += ["--dtypes", *({"fp32": "float32", "bf16": "bfloat16"}.get(d, d) for d in dtypes)]
        args += ["--allow-cpu"] if on_cpu else []
    elif name == "ops" and any(m.endswith("_compiled_bf16") for m in metrics):
        args.append("--compiled")
    elif name == "codebert":
        if cfg.get("config"):  # recorded as given, or absolute
            config = Path(cfg["config"])
            args += ["--config", str(config.relative_to(ROOT) if config.is_relative_to(ROOT) else config)]
        args += [a for lr in cfg.get("dense_lrs") or [] for a in ("--dense-lr", f"{lr:g}")]
        heldout = [a for h in cfg.get("heldout") or [] for a in ("--heldout", h)]
        args += heldout + (["--heldout-batches", str(cfg["heldout_batches"])] if heldout else [])
        ratio = (cfg.get("target") or {}).get("compression_ratio", 4.23)
        args += ["--target-ratio", f"{ratio:g}"] if ratio != 4.23 else []
    elif name == "trainer-rate" and "device" in cfg:
        args += ["--device", "cpu" if cfg["device"] == "cpu" else "cuda"]
    if cfg.get("recompute_factors"):
        args.append("--recompute-factors")
    elif cfg.get("recompute"):
        args.append("--recompute")
    if cfg.get("smoke"):
        args.append("--smoke")
    overrides = cfg.get("overrides") or []
    if name == "trainer-rate" and cfg.get("smoke"):
        from comera_dist.bench.trainer_rate import SMOKE_SETS  # --smoke's own overrides come first

        overrides = overrides[len(SMOKE_SETS):]
    args += [a for o in overrides for a in ("--set", o)]
    return [*env, "python", "-m", "comera_dist.bench", name, *args]


def command(name: str, result: dict[str, Any], stem: str | None = None) -> tuple[str, bool]:
    """(the command line that reproduces ``result``, whether the run recorded it): its ``bench_command``
    (``bench soak``'s before it: ``command``), else ``rebuilt_command``."""
    cfg = result["config"]
    recorded = cfg.get("bench_command") or (cfg.get("command") if name == "soak" else None)
    if recorded:
        return recorded, True
    return shlex.join(rebuilt_command(name, result, stem)), False


def render(bench_dir: Path, out: Path) -> str:
    results = {}
    for path in sorted(bench_dir.glob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "metrics" not in data or "benchmark" not in data:
            raise ValueError(f"summary: {path} is not a benchmark result (needs 'benchmark' and 'metrics')")
        results[path.stem] = data  # a variant (e.g. codebert-d384.json) gets its own section
    if not results:
        raise ValueError(f"summary: no benchmark JSON files in {bench_dir}")
    names = sorted(results, key=lambda n: (ORDER.index(results[n]["benchmark"]) if results[n]["benchmark"] in ORDER
                                           else len(ORDER), n))
    machines: dict[str, list[str]] = {}  # machine_line -> the results measured on it
    for n in names:
        machines.setdefault(machine_line(results[n].get("machine", {})), []).append(n)
    platforms = {m: sorted({results[n].get("machine", {}).get("platform", "unknown") for n in ns})
                 for m, ns in machines.items()}
    lines = ["# Benchmarks", "",
             "Generated by `python -m comera_dist.bench summary` from `docs/bench/*.json`; every number below is",
             "measured by the named benchmark on the machine its section names. Regenerate after re-running any of",
             "them. Contenders of one benchmark ran side by side in one run; compare ratios, not absolute times",
             "(the machine is shared and noisy). Runs the notes refer to but the page does not render",
             "(superseded or alternative settings) are kept in `docs/bench/raw/`.", "",
             "## Machine", "", "The benchmarks ran on these machines (each section names its own):", "",
             "| machine | platform | benchmarks |", "|---|---|---|",
             *(f"| {m} | {', '.join(platforms[m])} | {', '.join(ns)} |" for m, ns in machines.items()), "",
             "GPU figures: " + (", ".join(sorted({r["machine"]["gpu"] for r in results.values()
                                                   if r["machine"].get("gpu")})) or
                                "none (no GPU was lent to this run; every figure is CPU)") + ".", "",
             "| benchmark | command |", "|---|---|"]
    for n in names:
        text, recorded = command(results[n]["benchmark"], results[n], n)
        lines.append(f"| {n} | `{text}`{'' if recorded else ' ' + REBUILT} |")
    lines.append("")
    for n in names:
        lines += section(n, results[n], bench_dir, out.parent)
    text = "\n".join(lines).rstrip() + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(out)
    return text


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m comera_dist.bench summary", description=__doc__.splitlines()[0])
    p.add_argument("--bench-dir", type=Path, default=ROOT / "docs" / "bench", help="where the JSON results are")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md", help="the page to write")
    args = p.parse_args(argv)
    if not args.bench_dir.is_dir():
        p.error(f"--bench-dir {args.bench_dir} is not a directory")
    render(args.bench_dir, args.out)
    print(f"wrote {args.out}")
    return 0
