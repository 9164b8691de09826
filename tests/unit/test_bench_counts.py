"""A count of 0 given on the command line is a usage error (exit 2), never the benchmark's default: ``--steps 0``
of soak, trainer-rate, comm, layers and kernels, ``--batch-size 0`` of comm, layers, kernels and ops. Each check
comes before any work: the work itself is replaced by a function that fails the test if it runs."""

import re

import pytest

from comera_dist.bench import comm, kernels, layers, ops, soak, trainer_rate


def _never(*args, **kwargs):
    raise AssertionError("the benchmark ran instead of rejecting its arguments")


# module, the first thing it does after parsing its arguments (replaced by _never)
WORK = {soak: "run", trainer_rate: "_single_rank_env", comm: "measure", layers: "bench_linear",
        kernels: "measure_peaks", ops: "measure"}


@pytest.mark.parametrize(("mod", "argv"), [(soak, ["--steps", "0"]), (trainer_rate, ["--steps", "0"]),
                                           (comm, ["--steps", "0"]), (comm, ["--batch-size", "0"]),
                                           (layers, ["--steps", "0"]), (layers, ["--batch-size", "0"]),
                                           (kernels, ["--steps", "0"]), (kernels, ["--batch-size", "0"]),
                                           (ops, ["--batch-size", "0"])],
                         ids=lambda v: " ".join(v) if isinstance(v, list) else v.__name__.rsplit(".", 1)[1])
def test_a_zero_count_is_a_usage_error(mod, argv, monkeypatch, capsys):
    monkeypatch.setattr(mod, WORK[mod], _never)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # kernels sets it when it gets as far as its CPU smoke run
    with pytest.raises(SystemExit) as exc:
        mod.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert argv[0] in err and re.search(r"got (\d+ and )?0\b", err), err


def test_soak_rejects_a_batch_size_it_would_ignore(monkeypatch, capsys):
    monkeypatch.setattr(soak, "run", _never)
    with pytest.raises(SystemExit) as exc:
        soak.main(["--batch-size", "8"])
    assert exc.value.code == 2 and "deepspeed.micro_batch_size_per_gpu" in capsys.readouterr().err
