"""What torch.compile did in this process, for a benchmark's JSON: Dynamo's and inductor's counters,
and the state of inductor's CUDA-graph trees (``mode="reduce-overhead"``).

A compiled step can silently stop replaying its graphs: a re-recording at every step, a tree stuck
warming up (run eagerly in the graph pool) because each step's forward starts while a backward is
pending, or a graph skipped for an input mutation. Each costs a step's worth of launches or more and
shows only in a debug log. These numbers make it part of the result, with the host work left around
the graphs (``host_ops``) and the kernels the graphs launch (``graph_kernels``, for ``bench ops
--compiled`` and ``bench six-encoder``'s compiled rows)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

COMPILED_REGIONS = ("CompiledFunction", "CompiledFxGraph")
"""Profiler events of a compiled graph's forward and backward: ops under them ran in the graph."""


def host_ops(step: Callable[[], Any]) -> int:
    """Top-level aten ops one ``step`` dispatches outside compiled graphs, by ``torch.profiler`` (a dispatch
    mode would make Dynamo fall back to eager, so ``trainer_rate.aten_ops`` cannot count a compiled step). Top-level:
    not inside another aten op, so ``to`` counts once, not with its ``_to_copy``. Eager and compiled
    steps count the same way: for ``train.compile`` the host work left around the graphs (DeepSpeed's
    step, the session's objective and reads)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    count = 0
    for event in prof.events():
        if not event.name.startswith("aten::"):
            continue
        parent, counted = event.cpu_parent, True
        while parent is not None and counted:
            counted = not (parent.name.startswith("aten::") or any(r in parent.name for r in COMPILED_REGIONS))
            parent = parent.cpu_parent
        count += counted
    return count


def compile_counters() -> dict[str, dict[str, int]]:
    """What Dynamo and inductor counted in this process (``torch._dynamo.utils.counters``): frames
    compiled, graphs, graph breaks, and inductor's CUDA-graph counts (skipped graphs; the recorded
    graphs' non-static inputs, copied at every replay), so a compiled run's JSON (``train.compile``)
    says whether its graphs replayed as recorded."""
    from torch._dynamo.utils import counters

    kept = {"stats": counters["stats"], "graph_break": counters["graph_break"], "frames": counters["frames"],
            "inductor": {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}}
    return {group: {str(k): int(v) for k, v in found.items()} for group, found in kept.items()}


def cudagraph_trees(device: torch.device) -> dict[str, Any] | None:
    """The CUDA-graph tree of ``device`` in this thread (None off CUDA; zeros when nothing was compiled
    with CUDA graphs since the last ``torch.compiler.reset``):

    - ``functions``: compiled functions the tree manages (a training forward, its backward, an
      evaluation forward ...);
    - ``recorded_graphs``: graphs recorded in the tree. A steady training loop needs one per function
      and call position; a count that grows with the steps is a re-recording at every step;
    - ``rerecords``: re-recordings that inductor counted as unexpected (a changed input address, shape
      or liveness), out of ``cudagraph_unexpected_rerecord_limit`` per function;
    - ``new_recordings``: every recording after a tree was first completed, counted or not;
    - ``warmed_up_functions``: functions run once eagerly before their recording;
    - ``stuck_warming_up``: functions inductor warned about because a new invocation found the
      previous one's outputs alive or its backward pending, so it ran eagerly in the graph pool instead
      of replaying (the "Unable to hit fast path of CUDAGraphs" warning).

    Read from inductor's private tree manager (``torch._inductor.cudagraph_trees``); a torch that lacks
    one of these attributes gives ``{"error": ...}`` instead."""
    if device.type != "cuda":
        return None
    from torch._inductor import cudagraph_trees as trees

    try:
        manager = trees.get_manager(device.index if device.index is not None else torch.cuda.current_device(),
                                    create_if_none_exists=False)
        if manager is None:
            return {"functions": 0, "recorded_graphs": 0, "rerecords": 0, "new_recordings": 0,
                    "warmed_up_functions": 0, "stuck_warming_up": 0}
        pending = [node for nodes in manager.roots.values() for node in nodes]
        recorded = 0
        while pending:
            node = pending.pop()
            recorded += 1
            pending.extend(child for children in node.children.values() for child in children)
        return {"functions": len(manager.ids_to_funcs), "recorded_graphs": recorded,
                "rerecords": sum(n for per_node in manager.num_rerecord.values() for n in per_node.values()),
                "new_recordings": int(manager.debug_fail_counter),
                "warmed_up_functions": len(manager.warmed_up_functions),
                "stuck_warming_up": len(manager.warned_functions)}
    except (AttributeError, TypeError) as e:  # private API: report what changed rather than fail the run
        return {"error": f"{type(e).__name__}: {e}"}


GRAPH_CALL = "## Call CompiledFxGraph"
"""The profiler's record of one call of an inductor graph: its children are the graph's kernels."""


def kernel_profile() -> Any:
    """Context for compiling on the CPU so that ``graph_kernels`` sees the generated kernels: inductor's
    C++ kernels then open a profiler record each (``cpp.enable_kernel_profile``). A graph compiles on
    its first call, so the first steps must run inside it."""
    import torch._inductor.config as inductor

    return inductor.patch({"cpp.enable_kernel_profile": True})


def graph_kernels(step: Callable[[], Any]) -> dict[str, Any]:
    """The kernels that the inductor graphs of one ``step`` launch (on a GPU each is one launch, and
    inside a CUDA graph each costs about the same whatever its size): ``generated`` (inductor's fused
    kernels: C++ ``cpp_fused_*`` on the CPU, ``triton_*`` on a GPU) and ``extern`` (the library kernels a
    graph calls: GEMMs, attention ...), each split by the forward (``CompiledFunction``) and backward
    graphs, with ``externs`` by aten name. Ops outside the graphs (an optimizer step) are not counted:
    ``host_ops`` counts those. A graph replayed from a CUDA graph (``reduce-overhead``) has no kernels
    to see: count a compiled step without CUDA graphs.

    On the CPU the graphs must be compiled under ``kernel_profile()``. Raises when the step called no
    graph, or its graphs' kernels were not recorded, rather than report a count of zero."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    counts = {"generated": {"forward": 0, "backward": 0}, "extern": {"forward": 0, "backward": 0}}
    externs: dict[str, int] = {}
    calls = 0
    for event in prof.events():
        calls += event.name.startswith(GRAPH_CALL)
        parent = event.cpu_parent
        if parent is None or not parent.name.startswith(GRAPH_CALL):
            continue
        grand = parent.cpu_parent
        side = "backward" if grand is not None and "Backward" in grand.name else "forward"
        kind = "generated" if "cpp_fused" in event.name or event.name.startswith("triton_") else "extern"
        counts[kind][side] += 1
        if kind == "extern":
            externs[event.name] = externs.get(event.name, 0) + 1
    if calls == 0:
        raise RuntimeError("graph_kernels: the step called no inductor graph (is it compiled with inductor?)")
    if sum(counts["generated"].values()) == 0:
        raise RuntimeError("graph_kernels: no generated kernel was recorded (on the CPU, compile the step's "
                           "graphs inside compile_stats.kernel_profile())")
    total = sum(n for sides in counts.values() for n in sides.values())
    return {"kernels": total, "graph_calls": calls, **counts, "externs": dict(sorted(externs.items()))}
