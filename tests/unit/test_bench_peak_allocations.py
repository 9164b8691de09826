"""``bench.peak_allocations``: the blocks live at a step's peak, by the line that allocated them, replayed from the
caching allocator's event history (its format: ``torch.cuda.memory._snapshot()["device_traces"]``), or on the CPU
from ``torch.profiler``'s allocation events in that format."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from comera_dist.bench.peak_allocations import (
    NO_FRAME,
    cpu_trace,
    live_at_peak,
    peak_allocations,
    profiler_trace,
    where,
)

MiB = 2**20


def _frames(*sites: tuple[str, int, str]) -> list[dict]:
    return [{"filename": f, "line": line, "name": n} for f, line, n in sites]


FFN = _frames(("/x/torch/nn/functional.py", 10, "gelu"), ("/site/comera_dist/tensor/fused_ffn.py", 39, "forward"),
              ("/site/comera_dist/models/blocks.py", 111, "forward"))
ATTN = _frames(("/x/torch/nn/functional.py", 20, "softmax"), ("/site/comera_dist/models/blocks.py", 94, "forward"))
TORCH_ONLY = _frames(("/x/lib/torch/optim/adamw.py", 5, "step"), ("/me/script.py", 1, "<module>"))


def test_a_block_is_named_by_its_innermost_frame_of_the_package_else_torch():
    assert where(FFN) == "comera_dist/tensor/fused_ffn.py:39(forward)"  # innermost first, as recorded
    assert where(TORCH_ONLY) == "torch/optim/adamw.py:5(step)"
    assert where(_frames(("/me/script.py", 1, "<module>"))) == "/me/script.py:1(<module>)"
    assert where([]) == NO_FRAME  # autograd's engine allocating in backward
    # torch's own _functorch folder is torch's, not a package of its own
    assert where(_frames(("/x/torch/_functorch/_aot_autograd/x.py", 3, "f"))) == "torch/_functorch/_aot_autograd/x.py:3(f)"
    assert where(_frames(("comera_dist/layers/tt.py", 7, "g"))) == "comera_dist/layers/tt.py:7(g)"  # a relative path


def test_the_replay_finds_the_peak_and_what_was_live_then():
    trace = [
        {"action": "alloc", "addr": 1, "size": 4 * MiB, "frames": FFN},
        {"action": "alloc", "addr": 2, "size": 2 * MiB, "frames": ATTN},
        {"action": "alloc", "addr": 3, "size": 3 * MiB, "frames": FFN},  # the peak: 9 MiB live
        {"action": "free_requested", "addr": 1},
        {"action": "free_completed", "addr": 1},  # the same block once more: counted once
        {"action": "segment_alloc", "addr": 9, "size": 20 * MiB},  # segments are not tensors
        {"action": "alloc", "addr": 4, "size": 5 * MiB, "frames": TORCH_ONLY},  # 10 MiB, but block 1 is gone: 10
        {"action": "free_requested", "addr": 4},
        {"action": "free_requested", "addr": 77},  # allocated before the history began: ignored
        {"action": "alloc", "addr": 5, "size": 1 * MiB, "frames": ATTN},
    ]
    got = live_at_peak(trace, top=2)
    assert got["transient_peak_MiB"] == 10  # 2 + 3 + 5 after block 1 went
    assert got["rows"] == [
        {"where": "torch/optim/adamw.py:5(step)", "MiB": 5, "blocks": 1, "largest_MiB": 5},
        {"where": "comera_dist/tensor/fused_ffn.py:39(forward)", "MiB": 3, "blocks": 1, "largest_MiB": 3}]
    assert got["other_MiB"] == 2  # the attention block beyond the top 2


def _event(ns: int, ptr: int, size: int) -> SimpleNamespace:
    """A ``torch.profiler`` allocation event (a negative size is a free) with no Python frame above it."""
    return SimpleNamespace(start_time_ns=ns, typed=(None, SimpleNamespace(alloc_size=size, ptr=ptr)), parent=None)


def test_a_profiler_free_and_the_reuse_of_its_address_at_one_instant_replay_free_first():
    """The profiler stamps a free and the next allocation at that address alike; listed alloc first, the replay
    counted both blocks at once (a false peak) and then lost the new one with the free."""
    events = [_event(0, 1, 4 * MiB), _event(5, 1, 2 * MiB), _event(5, 1, -4 * MiB), _event(9, 2, 3 * MiB)]
    trace = profiler_trace(events)
    assert [(e["action"], e["addr"]) for e in trace] == [("alloc", 1), ("free_completed", 1), ("alloc", 1),
                                                           ("alloc", 2)]
    got = live_at_peak(trace)
    assert got["transient_peak_MiB"] == 5  # 2 + 3: never 4 + 2 at once
    assert got["rows"] == [{"where": NO_FRAME, "MiB": 5, "blocks": 2, "largest_MiB": 3}]


def test_an_empty_history_has_no_peak():
    assert live_at_peak([]) == {"transient_peak_MiB": 0, "rows": [], "other_MiB": 0}


def test_without_a_history_it_says_why_and_runs_nothing():
    ran = []
    got = peak_allocations(lambda: ran.append(1), torch.device("meta"))
    assert got == {"skipped": "no allocation history on meta (CUDA's allocator, or the CPU's profiler)"} and ran == []


def test_on_the_cpu_the_profiler_names_the_line_that_allocated_the_largest_live_block():
    """``cpu_trace``: the step's allocations and frees from ``torch.profiler``, replayed as CUDA's are. At the
    peak the 8 MiB block and the 1 MiB one are live, the 2 MiB one freed before them; the blocks are named by
    the innermost frame of the package (the test file is not in it: ``peak_allocations``' call of the step)."""
    def step():
        gone = torch.empty(2 * MiB // 4)
        del gone
        big = torch.empty(8 * MiB // 4)
        small = torch.ones(MiB // 4)
        return float(big.sum() + small.sum())

    got = peak_allocations(step, torch.device("cpu"))
    assert got["recorded_by"] == "torch.profiler" and "before_MiB" not in got
    assert got["transient_peak_MiB"] == pytest.approx(9, abs=0.01), got
    assert got["rows"][0]["largest_MiB"] == 8 and got["rows"][0]["MiB"] == pytest.approx(9, abs=0.01), got["rows"]
    # named by the call site: the line of cpu_trace that called the step (the step's own frame is the test's)
    lines, first = inspect.getsourcelines(cpu_trace)
    call = first + next(i for i, line in enumerate(lines) if line.strip() == "step()")
    assert got["rows"][0]["where"] == f"comera_dist/bench/peak_allocations.py:{call}(cpu_trace)", got["rows"]
    trace = cpu_trace(step)
    big = [(i, e) for i, e in enumerate(trace) if e.get("size", 0) >= MiB]  # the 2, 8 and 1 MiB allocations
    assert [e["size"] // MiB for _, e in big] == [2, 8, 1], big
    freed = [i for i, e in enumerate(trace) if e["action"] == "free_completed" and e["addr"] == big[0][1]["addr"]]
    assert freed and big[0][0] < freed[0] < big[1][0], (freed, big)  # the 2 MiB block freed before the 8 MiB one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the allocator's history)")
def test_a_real_step_names_the_line_that_allocated_its_largest_block():
    x = torch.ones(1024, device="cuda")

    def step():
        big = torch.empty(8 * MiB // 4, device="cuda")  # 8 MiB, the peak's largest block
        return (big.sum() + x.sum()).item()

    got = peak_allocations(step, torch.device("cuda"))
    # the innermost frame of the package: peak_allocations' call of the step (the test file is not in it)
    assert got["rows"][0]["largest_MiB"] == 8 and "comera_dist/bench/peak_allocations.py" in got["rows"][0]["where"]
    assert got["transient_peak_MiB"] >= 8 and got["before_MiB"] >= 1024 * 4 / MiB
    # the replay's bytes are the ones asked for: the allocator's own peak of those agrees, its blocks' is no less
    assert got["peak_requested_MiB"] == pytest.approx(got["transient_peak_MiB"], abs=0.01)
    assert got["peak_allocated_MiB"] >= got["peak_requested_MiB"]


def test_gpu_checks_summary_prints_a_recorded_peak(tmp_path, capsys):
    """``launch/gpu_check.py summary`` on a result as a GPU records it (the CPU's has no ``before_MiB``)."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("gpu_check", Path(__file__).parents[2] / "launch/gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    (tmp_path / "results.tsv").write_text("bench-six-encoder-peaks\t0\t30.0\tlogs/x.log\n")
    trace = [{"action": "alloc", "addr": 1, "size": 3 * MiB, "frames": FFN}]
    recorded = {"before_MiB": 18.0, "peak_allocated_MiB": 3.5, "peak_requested_MiB": 3.0, **live_at_peak(trace)}
    (tmp_path / "six-encoder-peaks.json").write_text(json.dumps(
        {"metrics": {}, "config": {"peak_allocations": {"comera eager fp32 b1": recorded}}}))
    assert gpu_check.summary(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert ("six-encoder-peaks comera eager fp32 b1 peak allocations: 18.0 MiB before the step, 3.0 MiB more at its "
            "peak as asked for (3.5 in the allocator's blocks): comera_dist/tensor/fused_ffn.py:39(forward) 3.00") in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["peak_allocations"]["six-encoder-peaks comera eager fp32 b1"]["rows"][0]["MiB"] == 3
