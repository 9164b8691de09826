"""``bench.trainer_rate.targets``: a run that also captured the bare step in a CUDA graph is held to that
step too, so a compiled trainer cannot pass by beating only the eager step."""

from comera_dist.bench.trainer_rate import TARGET, targets


def test_an_eager_only_run_has_the_eager_target():
    assert targets({"trainer_rate_over_bench": 0.6}) == {"trainer_rate_over_bench": TARGET}


def test_a_run_with_the_captured_bare_step_is_held_to_it_as_well():
    # the H200's compiled trainer (fourteenth session): 2.62x the eager bare step, 0.52 of the captured one
    got = targets({"trainer_rate_over_bench": 2.62, "trainer_rate_over_bench_graph": 0.52})
    assert got == {"trainer_rate_over_bench": TARGET, "trainer_rate_over_bench_graph": TARGET}
