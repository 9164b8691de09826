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
