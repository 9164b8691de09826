"""What is allocated at the peak of one step, by the line of code that allocated it (CUDA's allocator history;
on the CPU, ``torch.profiler``'s allocation events).

``torch.cuda.max_memory_allocated`` gives a step's peak as one number. The batch-1 memory target of issue 11
needs to know what that number is made of: on the H200, CoMERA's 122.4 MiB held 66 MiB of cuBLAS workspace and
56 MiB of its own, of which parameters, gradients and AdamW moments are about 18. This records the caching
allocator's events during one step (``torch.cuda.memory._record_memory_history``, Python stacks), replays them
to the moment the most bytes were live, and groups the blocks live then by the innermost frame of this package
(else of torch) that allocated them. What was allocated before the step (parameters, optimizer state,
workspaces made earlier) is not in the history: it is ``before_MiB``.

On the CPU the profiler records each allocation and free of the step with the Python calls it ran under
(``cpu_trace``), which replay the same way; a frame's line is where it made the next inner call, the innermost
frame's its ``def`` line (the profiler records call sites only), and what built-in ops allocate in backward
goes under the frame that called ``backward()``. The CPU has no allocator statistics: no ``before_MiB`` and no
allocator peaks there, and the model's CPU paths differ from the GPU's in places (the CPU's dropout and
attention, ``tensor.smallops``). It is what found what ``model.recompute_factors`` frees.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

FREES = ("free_requested", "free_completed")


NO_FRAME = "(no Python frame: autograd's backward of a built-in op, or C++)"


def _in(package: str, filename: str) -> str | None:
    """``filename`` from ``package``'s root (``comera_dist/...``), or None outside it (``torch/_functorch/`` is
    torch's, not a package ``torch/`` of its own)."""
    if not package:
        return filename
    at = filename.rfind("/" + package)
    return filename[at + 1:] if at >= 0 else (filename if filename.startswith(package) else None)


def where(frames: Iterable[Mapping[str, Any]]) -> str:
    """The innermost frame in ``comera_dist`` (else in ``torch``, else any) as ``path:line(name)``, the path
    from the package root. Blocks that autograd's engine allocates in backward for built-in ops have no Python
    frame (``NO_FRAME``); a custom ``autograd.Function``'s backward has its own."""
    frames = list(frames)
    for package in ("comera_dist/", "torch/", ""):
        for f in frames:  # innermost first, as the allocator records them
            short = _in(package, str(f.get("filename", "")))
            if short:
                return f"{short}:{f.get('line', '?')}({f.get('name', '?')})"
    return NO_FRAME


def live_at_peak(trace: Iterable[Mapping[str, Any]], top: int = 15) -> dict[str, Any]:
    """Replay one device's allocator events (``alloc``, then ``free_requested``/``free_completed`` of the same
    address): the bytes live at the peak, grouped by ``where`` they were allocated, largest first (``top``
    groups; the rest summed as ``other_MiB``). A block freed twice (requested, then completed) counts once.
    The events carry the sizes asked for: the allocator's own figures count whole blocks (rounded up to 512 B,
    a large block not split for less than 1 MiB), so these fall a little short of ``max_memory_allocated``."""
    events = list(trace)

    def replay(upto: int | None) -> tuple[int, int, dict[int, tuple[int, str]]]:
        live: dict[int, tuple[int, str]] = {}
        total = best = best_at = 0
        for i, e in enumerate(events if upto is None else events[:upto + 1]):
            if e.get("action") == "alloc":
                live[e["addr"]] = (int(e["size"]), where(e.get("frames") or ()))
                total += int(e["size"])
                if total > best:
                    best, best_at = total, i
            elif e.get("action") in FREES and e["addr"] in live:
                total -= live.pop(e["addr"])[0]
        return best, best_at, live

    best, best_at, _ = replay(None)
    _, _, live = replay(best_at) if best else (0, 0, {})
    groups: dict[str, list[int]] = {}
    for size, at in live.values():
        groups.setdefault(at, []).append(size)
    rows = sorted(({"where": at, "MiB": sum(s) / 2**20, "blocks": len(s), "largest_MiB": max(s) / 2**20}
                   for at, s in groups.items()), key=lambda r: r["MiB"], reverse=True)
    return {"transient_peak_MiB": best / 2**20, "rows": rows[:top],
            "other_MiB": sum(r["MiB"] for r in rows[top:])}


def peak_allocations(step: Callable[[], object], device: torch.device, top: int = 15) -> dict[str, Any]:
    """Run ``step()`` once with the allocator's history recorded and return ``live_at_peak`` of it, with
    ``before_MiB`` (allocated when the step began) and the allocator's own peaks of the step in whole blocks
    and in bytes asked for (``peak_allocated_MiB``, ``peak_requested_MiB``; the replay's figures are the
    latter's kind). On the CPU ``live_at_peak`` of ``cpu_trace`` only, with ``recorded_by``. On another device,
    or if the history cannot be recorded, a dict that says why (``skipped``/``error``), so the benchmark's timings
    stand."""
    if device.type == "cpu":
        try:
            return {"recorded_by": "torch.profiler", **live_at_peak(cpu_trace(step), top)}
        except (ImportError, RuntimeError, TypeError, AttributeError) as e:  # the profiler's event tree changed
            return {"error": f"{type(e).__name__}: {e}"[:300]}
    if device.type != "cuda":
        return {"skipped": f"no allocation history on {device.type} (CUDA's allocator, or the CPU's profiler)"}
    memory = torch.cuda.memory
    torch.cuda.synchronize(device)
    start = torch.cuda.memory_stats(device)  # what the step's peaks are counted above, in each unit
    before = start.get("allocated_bytes.all.current", 0)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        # an earlier recording's events (another contender's step, whose later frees were not recorded) must not
        # be replayed with this step's: switching the recording off clears them (below), clear_history too
        memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=1_000_000,
                                      clear_history=True)
        try:
            step()
            torch.cuda.synchronize(device)
            snapshot = memory._snapshot()
        finally:
            memory._record_memory_history(enabled=None)
    except (RuntimeError, TypeError, AttributeError) as e:  # an API another torch lacks: say so, keep the run
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    stats = torch.cuda.memory_stats(device)
    traces = snapshot.get("device_traces") or []
    index = device.index if device.index is not None else torch.cuda.current_device()
    return {"before_MiB": before / 2**20,
            "peak_allocated_MiB": (stats.get("allocated_bytes.all.peak", 0) - before) / 2**20,
            "peak_requested_MiB": (stats.get("requested_bytes.all.peak", 0)
                                   - start.get("requested_bytes.all.current", 0)) / 2**20,
            **live_at_peak(traces[index] if index < len(traces) else [], top)}


_PY_CALL = re.compile(r"^(?P<filename>.*)\((?P<line>\d+)\): (?P<name>.*)$")


def cpu_trace(step: Callable[[], object]) -> list[dict[str, Any]]:
    """Run ``step()`` under ``torch.profiler`` (memory and Python stacks) and return its CPU allocations and frees
    in order, in the allocator history's format (``alloc`` with ``addr``, ``size`` and ``frames`` innermost
    first; ``free_completed``), for ``live_at_peak``. A free of memory allocated before the step is in it too
    (the replay ignores it)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
        step()
    found, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        todo.extend(e.children)
        if e.typed[0] == _EventType.Allocation and e.typed[1].device.type == "cpu":
            found.append(e)
    return profiler_trace(found)


def profiler_trace(events: Iterable[Any]) -> list[dict[str, Any]]:
    """``torch.profiler``'s allocation events (a negative ``alloc_size`` is a free) as the allocator history's
    events, in time order. At one instant the frees come first: the profiler stamps a block's free and the
    reuse of its address alike, and the replay keys live blocks by address."""
    trace: list[dict[str, Any]] = []
    for e in sorted(events, key=lambda e: (e.start_time_ns, e.typed[1].alloc_size > 0)):
        fields = e.typed[1]
        if fields.alloc_size > 0:
            trace.append({"action": "alloc", "addr": fields.ptr, "size": fields.alloc_size, "frames": _py_frames(e)})
        else:
            trace.append({"action": "free_completed", "addr": fields.ptr})
    return trace


def _py_frames(event: Any) -> list[dict[str, Any]]:
    """The Python calls ``event`` ran under, innermost first, as the allocator history's frames. The profiler
    records where each call was made (its ``caller``), not the line a function is at: a frame's line is where it
    called the next inner frame, and the innermost frame's (no inner call) is its function's ``def`` line."""
    from torch._C._profiler import _EventType

    frames: list[dict[str, Any]] = []
    inner_call_line = None  # where the frame below called into the next inner one
    e = event.parent
    while e is not None:
        if e.typed[0] == _EventType.PyCall and (m := _PY_CALL.match(e.name)):
            line = int(m["line"]) if inner_call_line is None else inner_call_line
            frames.append({"filename": m["filename"], "line": line, "name": m["name"]})
            caller = getattr(e.typed[1], "caller", None)
            inner_call_line = getattr(caller, "line_number", None)
        e = e.parent
    return frames
