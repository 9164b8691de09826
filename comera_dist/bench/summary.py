"""``python -m comera_dist.bench summary``: regenerate ``docs/benchmarks.md`` from ``docs/bench/*.json``.

Every number in the page comes from a benchmark's JSON (written by ``--json``): the machine
description and load, each row table, each target with the measured value and, for a missed
target, the gap and the profiled cause (the top ``torch.profiler`` ops the benchmark recorded).
Hand-written analysis, if any, lives in ``docs/bench/notes/<benchmark>.md`` and is included
verbatim under its benchmark. Plots are written next to the JSON as ``<benchmark>.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ORDER = ("six-encoder", "galore", "codebert", "prune-payoff", "memory", "comm", "layers", "kernels", "ops",
         "soak")
# benchmark -> [(metric, rule, target, what it compares)]; rule: ">=", "<=" or "within" (lo, hi)
TARGETS: dict[str, list[tuple[str, str, Any, str]]] = {
    "six-encoder": [("speedup_vs_dense_b32", ">=", 5.0, "CoMERA step vs dense step, batch 32 (CPU)")],
    "galore": [("speedup_vs_galore_b1", ">=", 6.0, "CoMERA step vs GaLoreAdamW step, batch 1"),
               ("memory_ratio_galore_over_comera_b1", ">=", 10.0, "tensor memory, GaLore / CoMERA, batch 1")],
    "codebert": [("compression_ratio", ">=", 4.23, "whole-model compression at the end of training"),
                 ("val_loss_ratio_comera_over_dense", "<=", 1.03, "final validation MLM loss, CoMERA / dense"),
                 ("epoch_speedup_vs_dense", ">=", 3.0, "training time for the same tokens, dense / CoMERA")],
    "prune-payoff": [("step_time_ratio_over_flop_ratio", "within", (0.8, 1.2),
                      "(step time after / before pruning) / (FLOPs after / before)")],
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
        return value >= target, f"{target / value:.2f}x short" if value > 0 else "no gain"
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


def section(name: str, result: dict[str, Any], bench_dir: Path, doc_dir: Path) -> list[str]:
    """The page section of the result in ``<name>.json`` (targets and plot by its ``benchmark``)."""
    cfg, metrics, kind = result["config"], result["metrics"], result["benchmark"]
    lines = [f"## {name}", ""]
    load = (cfg.get("load_avg_start"), cfg.get("load_avg_end"))
    run = {k: v for k, v in cfg.items() if k in ("steps", "batch_size", "batch_sizes", "seq_len", "threads",
                                                  "smoke", "keep", "loop", "galore", "config", "overrides", "recompute",
                                                  "schedule_scale", "dense_lrs", "dense_lr")}
    lines += [f"Run settings: `{json.dumps(run)}`.", ""]
    if all(load):
        lines += [f"1-min load average at start / end: {load[0][0]:.1f} / {load[1][0]:.1f} (2 cores).", ""]
    gpu = result.get("machine", {}).get("gpu")
    lines += [f"Device: {'GPU ' + gpu if gpu else 'CPU'}.", ""]
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
            value = metrics.get(metric)
            if value is None:
                lines.append(f"| `{metric}` | {what} | {rule} {_fmt(target)} | missing | not measured |")
                continue
            met, gap = check(rule, target, float(value))
            lines.append(f"| `{metric}` | {what} | {rule} {_fmt(target)} | {_fmt(float(value))} | "
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


def command(name: str, cfg: dict[str, Any], stem: str | None = None) -> str:
    """The command line that reproduces a result: the one it recorded (``bench_command``), else one
    rebuilt from the settings it recorded."""
    if cfg.get("bench_command"):
        return cfg["bench_command"]
    parts = [f"python -m comera_dist.bench {name} --json docs/bench/{stem or name}.json"]
    for key, flag in (("steps", "--steps"), ("batch_size", "--batch-size"), ("keep", "--keep"),
                      ("eval_every", "--eval-every"), ("eval_batches", "--eval-batches"), ("threads", "--threads")):
        if isinstance(cfg.get(key), (int, float, str)):  # a per-policy mapping (bench ops' threads) is no flag
            parts.append(f"{flag} {cfg[key]}")
    parts += [f"--set {o}" for o in cfg.get("overrides") or []]
    if cfg.get("smoke"):
        parts.append("--smoke")
    return " ".join(parts)


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
    machine = next(iter(results.values()))["machine"]
    lines = ["# Benchmarks", "",
             "Generated by `python -m comera_dist.bench summary` from `docs/bench/*.json`; every number below is",
             "measured by the named benchmark on the machine described here. Regenerate after re-running any of",
             "them. Contenders of one benchmark ran side by side in one run; compare ratios, not absolute times",
             "(the machine is shared and noisy). Runs the notes refer to but the page does not render",
             "(superseded or alternative settings) are kept in `docs/bench/raw/`.", "",
             "## Machine", "", f"`{json.dumps(machine)}`", "",
             "GPU figures: " + (", ".join(sorted({r["machine"]["gpu"] for r in results.values()
                                                   if r["machine"].get("gpu")})) or
                                "none (no GPU was lent to this run; every figure is CPU)") + ".", "",
             "| benchmark | command |", "|---|---|"]
    lines += [f"| {n} | `{command(results[n]['benchmark'], results[n]['config'], n)}` |" for n in names]
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
