"""write_report: the end-of-run markdown report with PNG plots (loss, compression, rank heatmap)."""

from __future__ import annotations

import math
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on cluster nodes; must precede pyplot
import matplotlib.pyplot as plt

from comera_dist.metrics.history import History


def write_report(history: History, output_dir: str | Path, *, run_name: str, world_size: int,
                 total_steps: int) -> Path:
    """Write ``output_dir/report.md`` and the PNGs it links; return the markdown path."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    images = {}
    if _plot_lines(history, ["train_loss", "val_loss"], "loss", out / "report_loss.png"):
        images["Loss"] = "report_loss.png"
    if _plot_lines(history, ["compression_ratio", "compression_ratio_tensorized"], "compression ratio (x)",
                   out / "report_compression.png"):
        images["Compression ratio"] = "report_compression.png"
    if _plot_rank_heatmap(history, out / "report_ranks.png"):
        images["Active TT ranks"] = "report_ranks.png"

    lines = [f"# Run report: {run_name}", "",
             f"- processes: {world_size}", f"- steps configured: {total_steps}"]
    last_step = max((s for series in history.scalars.values() for s, _ in series), default=None)
    lines.append(f"- last step logged: {last_step if last_step is not None else 'none'}")
    ok = sum(1 for _, good, _ in history.checkpoints if good)
    lines.append(f"- checkpoints: {ok} saved, {len(history.checkpoints) - ok} failed")
    switch = _stage_switch(history)
    lines.append(f"- late stage from step {switch}" if switch is not None else "- stayed in the early stage")
    best = history.best("val_loss")
    if best:
        lines.append(f"- best validation loss: {best[1]:.4f} at step {best[0]}")
    lines += ["", "## Final values", "", "| metric | first | last | min | max |", "|---|---|---|---|---|"]
    for key, series in sorted(history.scalars.items()):
        low, high = (history.best(key, lowest=lowest) or (None, math.nan) for lowest in (True, False))
        lines.append(f"| {key} | {_fmt(series[0][1])} | {_fmt(series[-1][1])} | {_fmt(low[1])} | {_fmt(high[1])} |")
    if history.ranks and any(snap for _, snap in history.ranks):  # a dense run snapshots no layer
        step, final = history.ranks[-1]
        first = history.ranks[0][1]
        lines += ["", f"## TT ranks (first logged -> step {step})", "", "| layer | ranks |", "|---|---|"]
        for layer in sorted(final):
            lines.append(f"| {layer} | {first.get(layer, '?')} -> {final[layer]} |")
    for title, name in images.items():
        lines += ["", f"## {title}", "", f"![{title}]({name})"]
    path = out / "report.md"
    tmp = out / f".report.md.{os.getpid()}.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def _fmt(v: float) -> str:
    return f"{v:.6g}"


def _plot_lines(history: History, keys: list[str], ylabel: str, path: Path) -> bool:
    present = [k for k in keys if history.scalars.get(k)]
    if not present:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in present:
        steps, values = zip(*history.scalars[key])
        ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=key)
    switch = _stage_switch(history)
    if switch is not None:
        ax.axvline(switch, color="grey", linestyle="--", linewidth=1, label="late stage")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _stage_switch(history: History) -> int | None:
    """First step logged in the late stage (stage 1), if the run got there."""
    return next((s for s, v in history.scalars.get("stage", []) if v >= 1), None)


def _plot_rank_heatmap(history: History, path: Path) -> bool:
    """Rows: (layer, bond); columns: rank snapshots over time; colour: active rank. None drawn without a bond (a
    dense run, ``comera.enabled=false``, snapshots no layer)."""
    rows = sorted({(layer, b) for _, snap in history.ranks for layer, bonds in snap.items()
                   for b in range(len(bonds))})
    if not rows:
        return False
    grid = [[math.nan] * len(history.ranks) for _ in rows]  # (bonds, snapshots)
    index = {row: i for i, row in enumerate(rows)}
    for j, (_, snap) in enumerate(history.ranks):
        for layer, bonds in snap.items():
            for b, r in enumerate(bonds):
                grid[index[(layer, b)]][j] = r
    steps = [s for s, _ in history.ranks]
    fig, ax = plt.subplots(figsize=(8, max(2.5, 0.22 * len(rows) + 1.5)))
    top = max((r for row in grid for r in row if not math.isnan(r)), default=1)
    # the scale starts at 0 so that shrinking ranks read as shrinking, not as a relative wobble
    im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0, vmax=max(top, 1))
    ax.set_yticks(range(len(rows)), [f"{layer}[{b}]" for layer, b in rows], fontsize=6)
    ticks = sorted({0, len(steps) - 1, *range(0, len(steps), max(1, len(steps) // 8))})
    ax.set_xticks(ticks, [str(steps[t]) for t in ticks])
    ax.set_xlabel("step")
    fig.colorbar(im, ax=ax, label="active rank")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
