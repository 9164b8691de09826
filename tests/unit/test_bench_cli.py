"""``python -m comera_dist.bench``: the listed benchmarks are exactly the runnable ones (bench/__main__.py)."""

import importlib
import pkgutil

import pytest

import comera_dist.bench as bench_pkg
from comera_dist.bench.__main__ import available, main

HELPERS = {"common", "compile-stats", "graphed", "host-profile", "kernel-time", "peak-allocations",
           "six-encoder-device"}
"""Modules the benchmarks import, without a ``main`` of their own."""


def test_every_listed_benchmark_has_a_main_and_every_module_with_one_is_listed():
    names = available()
    assert names and not HELPERS & set(names)
    for name in names:
        module = importlib.import_module(f"comera_dist.bench.{name.replace('-', '_')}")
        assert callable(getattr(module, "main", None)), name
    modules = {m.name.replace("_", "-") for m in pkgutil.iter_modules(bench_pkg.__path__)} - {"--main--"}
    assert set(names) | HELPERS == modules  # a new module is either a benchmark or a known helper


def test_help_lists_the_benchmarks(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "benchmarks: " + ", ".join(available()) in out
    assert "host-profile" not in out.split("benchmarks:")[1]


@pytest.mark.parametrize("name, why", [("host-profile", "'host-profile' is a helper of the benchmarks (no main)"),
                                       ("no-such-bench", "unknown benchmark 'no-such-bench'")])
def test_a_name_that_is_not_a_benchmark_is_a_usage_error(capsys, name, why):
    assert main([name, "--json", "x.json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m comera_dist.bench <name> [options]\n")
    assert why in err and "available: " + ", ".join(available()) in err


@pytest.mark.parametrize("args, why", [
    (["six-encoder", "--device", "tpu"], "argument --device: 'tpu' is not a device: cpu, cuda or cuda:N"),
    (["trainer-rate", "--device", "meta"], "argument --device: 'meta': the benchmarks run on cpu, cuda or cuda:N"),
    (["ops", "--json", "{tmp}"], "argument --json: {tmp} is a directory; give a file path"),
    (["ops", "--json", "{tmp}/file/out.json"], ("argument --json: {tmp}/file/out.json: {tmp}/file is a file, not a "
                                               "directory")),
    (["memory-probe", "--json", "{tmp}/file/m.json"], "{tmp}/file is a file, not a directory"),
])
def test_a_bad_output_path_or_device_is_a_usage_error_before_anything_runs(capsys, tmp_path, args, why):
    """They crashed after the measuring (the result lost), or at the first CUDA call, with a traceback."""
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        main([a.format(tmp=tmp_path) for a in args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert why.format(tmp=tmp_path) in err.splitlines()[-1], err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_visible_device_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["six-encoder", "--device", "cuda"])
    assert e.value.code == 2 and "--device cuda: no CUDA device is visible" in capsys.readouterr().err


def test_a_config_a_benchmark_loads_is_one_line_exit_2(capsys):
    assert main(["trainer-rate", "--smoke", "--set", "train.stepz=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m comera_dist.bench trainer-rate: error: "), err
    assert "unknown config key 'train.stepz'; did you mean 'steps'?" in err
