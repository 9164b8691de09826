"""RankController: stage schedule, the lambda rule, the two objectives, state round trip.

The late stage running inside a real training of a TT model, with lambda switching in
both directions, is shown in test_compression_training.py.
"""

import json

import pytest
import torch

from comera_dist.compression.config import ControllerConfig
from comera_dist.compression.controller import RankController, RanksCollapsed


def _losses():
    L = torch.tensor(2.0, requires_grad=True)
    R = torch.tensor(0.8, requires_grad=True)
    return L, R


def test_early_stage_is_weighted_sum_with_gamma():
    ctl = RankController(ControllerConfig(gamma=0.05))
    L, R = _losses()
    assert not ctl.advance(0, global_loss=2.0, global_size=1000)
    loss = ctl.objective(L, R, global_loss=2.0, global_size=1000)
    loss.backward()
    assert ctl.stage == "early" and ctl.lam is None
    assert loss.item() == pytest.approx(2.0 + 0.05 * 0.8)
    assert (L.grad.item(), R.grad.item()) == pytest.approx((1.0, 0.05))


def test_switch_by_step_sets_target_size():
    ctl = RankController(ControllerConfig(late_stage_step=3, target_ratio=0.25))
    assert [ctl.advance(s, global_loss=3.0, global_size=800) for s in range(3)] == [False] * 3
    assert ctl.advance(3, global_loss=3.0, global_size=800)
    assert ctl.stage == "late"
    assert (ctl.state.switch_step, ctl.state.size_at_switch, ctl.state.target_size) == (3, 800, 200.0)
    assert not ctl.advance(4, global_loss=3.0, global_size=400)  # switches once; S* stays
    assert ctl.state.target_size == 200.0


def test_switch_by_loss_criterion():
    ctl = RankController(ControllerConfig(late_stage_loss=1.5))
    assert not ctl.advance(0, global_loss=1.6, global_size=100)
    assert ctl.advance(1, global_loss=1.5, global_size=100)
    assert ctl.stage == "late" and ctl.state.switch_step == 1


@pytest.mark.parametrize(("losses", "switch_at"), [
    ([3.0, 2.0, 1.4, 1.0], 2),  # the loss criterion comes first: it is not ignored when a step is set
    ([3.0, 2.0, 1.8, 1.6], 3),  # the loss never gets there: the step criterion alone switches
])
def test_both_criteria_switch_at_whichever_comes_first(losses, switch_at):
    ctl = RankController(ControllerConfig(late_stage_step=3, late_stage_loss=1.5, target_ratio=0.5))
    switched = [ctl.advance(step, global_loss=loss, global_size=1000 - step) for step, loss in enumerate(losses)]
    assert switched == [step == switch_at for step in range(len(losses))]
    assert (ctl.state.switch_step, ctl.state.size_at_switch) == (switch_at, 1000 - switch_at)


def test_no_schedule_never_switches():
    ctl = RankController(ControllerConfig())
    assert not any(ctl.advance(s, global_loss=0.01, global_size=10) for s in range(100))
    assert ctl.stage == "early"


@pytest.mark.parametrize(
    ("loss", "size", "lam"),
    [
        # S* = 500 (size gap 0.5 at S = 1000); L* = 1
        (4.0, 1000, 0),  # task gap 0.75 > 0.5: push the task loss
        (1.5, 1000, 1),  # task gap 1/3 < 0.5: push the size
        (1.5, 600, 0),  # size gap 1/6 < 1/3: back to the task loss
        (1.1, 600, 1),  # task gap 1/11 < 1/6
    ],
)
def test_lambda_rule_and_late_objective(loss, size, lam):
    ctl = RankController(ControllerConfig(late_stage_step=0, target_ratio=0.5, target_loss=1.0))
    ctl.advance(0, global_loss=4.0, global_size=1000)
    L, R = _losses()
    out = ctl.objective(L, R, global_loss=loss, global_size=size)
    out.backward()
    assert ctl.lam == lam
    assert out.item() == pytest.approx(0.1 * 2.0 + 0.01 * 0.8 + lam * 0.8 + (1 - lam) * 2.0)
    assert (L.grad.item(), R.grad.item()) == pytest.approx((0.1 + 1 - lam, 0.01 + lam))


@pytest.mark.parametrize("lam_loss,lam", [(4.0, 0), (1.1, 1)])
def test_late_objective_uses_the_configured_weights(lam_loss, lam):
    """Non-default always-on weights (the defaults 0.1 / 0.01 must not be constants in the code)."""
    ctl = RankController(ControllerConfig(late_stage_step=0, target_loss=1.0, late_task_weight=0.3,
                                          late_rank_weight=0.07))
    ctl.advance(0, global_loss=4.0, global_size=1000)
    L, R = _losses()
    out = ctl.objective(L, R, global_loss=lam_loss, global_size=1000)
    out.backward()
    assert ctl.lam == lam
    assert out.item() == pytest.approx(0.3 * 2.0 + 0.07 * 0.8 + lam * 0.8 + (1 - lam) * 2.0)
    assert (L.grad.item(), R.grad.item()) == pytest.approx((0.3 + 1 - lam, 0.07 + lam))


def test_lambda_uses_global_values_not_the_local_loss():
    ctl = RankController(ControllerConfig(late_stage_step=0, target_loss=1.0))
    ctl.advance(0, global_loss=4.0, global_size=1000)
    local = torch.tensor(100.0)  # a rank's own loss far from target must not decide lambda
    ctl.objective(local, torch.tensor(1.0), global_loss=1.1, global_size=1000)
    assert ctl.lam == 1


def test_state_dict_round_trip_and_lambda_switch_count():
    cfg = ControllerConfig(late_stage_step=0, target_loss=1.0)
    ctl = RankController(cfg)
    ctl.advance(0, global_loss=4.0, global_size=1000)
    for loss in (4.0, 1.1, 4.0):
        ctl.objective(torch.tensor(loss), torch.tensor(1.0), global_loss=loss, global_size=1000)
    assert ctl.state.lam_switches == 2 and ctl.lam == 0
    other = RankController(cfg)
    other.load_state_dict(json.loads(json.dumps(ctl.state_dict())))  # plain data: JSON-safe
    assert other.state == ctl.state
    # the restored controller continues identically
    a = ctl.objective(torch.tensor(1.1), torch.tensor(1.0), global_loss=1.1, global_size=1000)
    b = other.objective(torch.tensor(1.1), torch.tensor(1.0), global_loss=1.1, global_size=1000)
    assert a.item() == b.item() and other.state.lam_switches == 3


def test_a_resume_with_another_target_ratio_moves_s_star_from_the_size_at_the_switch():
    ctl = RankController(ControllerConfig(late_stage_step=0, target_ratio=0.5))
    assert ctl.retarget() is None  # the early stage has no S*
    ctl.advance(0, global_loss=4.0, global_size=1000)
    assert ctl.retarget() is None and ctl.state.target_size == 500.0  # the ratio it switched with
    resumed = RankController(ControllerConfig(late_stage_step=0, target_ratio=0.2))
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.retarget() == (500.0, 200.0) and resumed.state.target_size == 200.0
    assert resumed.state.size_at_switch == 1000 and resumed.retarget() is None


def test_bad_state_and_bad_globals_are_clear_errors():
    ctl = RankController(ControllerConfig(late_stage_step=0))
    with pytest.raises(ValueError, match=r"unknown keys \['bogus'\]"):
        ctl.load_state_dict({**ctl.state_dict(), "bogus": 1})
    with pytest.raises(ValueError, match=r"stage must be 'early' or 'late', got 'middle'"):
        ctl.load_state_dict({**ctl.state_dict(), "stage": "middle"})
    late = RankController(ControllerConfig(late_stage_step=0))
    late.advance(0, global_loss=2.0, global_size=10)  # switches: a late state with its target size
    assert late.state_dict()["stage"] == "late"
    with pytest.raises(ValueError, match="late stage without target_size"):
        ctl.load_state_dict({**late.state_dict(), "target_size": None})
    with pytest.raises(ValueError, match=r"missing keys \['lam_switches'\]"):
        ctl.load_state_dict({k: v for k, v in late.state_dict().items() if k != "lam_switches"})
    with pytest.raises(ValueError, match=r"global_loss must be finite and > 0, got nan"):
        ctl.advance(0, global_loss=float("nan"), global_size=10)
    with pytest.raises(ValueError, match=r"global_loss must be finite and > 0, got inf"):
        ctl.advance(0, global_loss=float("inf"), global_size=10)
    with pytest.raises(ValueError, match=r"global_size must be > 0, got -1"):
        ctl.advance(0, global_loss=1.0, global_size=-1)
    with pytest.raises(RanksCollapsed, match=r"every rank of every TT layer is dead .*comera\.controller\.gamma"):
        ctl.advance(0, global_loss=1.0, global_size=0)
    with pytest.raises(RuntimeError, match="late stage has not begun"):
        ctl.decide_lambda(1.0, 10)


# ---------------------------------------------------------------- the session's sync-free driving
def _f64(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float64)


@pytest.mark.parametrize("loss", [4.0, 2.0, 1.5, 1.1, 1.2, 1.0 + 1e-12, 0.7])
@pytest.mark.parametrize("size", [1100.0, 1000.0, 600.0, 549.5, 550.5, 833.3333333333334])
def test_lambda_on_the_device_is_the_host_rule(loss, size):
    """Same L and S (the all-reduced float64 means), same lambda and objective, whichever side decides.
    The grid has equal gaps (L 2, S 1100: both 0.5, so lambda 0), ties of the host's ``round`` (549.5,
    550.5: half to even) and gaps within 1e-12."""
    host = RankController(ControllerConfig(late_stage_step=0, target_ratio=0.5, target_loss=1.0))
    host.advance(0, global_loss=4.0, global_size=1100)  # S* = 550
    device = RankController(host.cfg)
    device.load_state_dict(host.state_dict())
    (L1, R1), (L2, R2) = _losses(), _losses()
    want = host.objective(L1, R1, global_loss=loss, global_size=round(size))
    got, lam = device.objective_on_device(L2, R2, global_loss=_f64(loss), global_size=_f64(size))
    size_gap = (round(size) - 550) / round(size)
    assert host.lam == int((loss - 1.0) / loss < size_gap)  # strict: equal gaps keep lambda 0
    assert lam.dtype == torch.bool and lam.shape == () and int(lam) == host.lam
    want.backward()
    got.backward()
    assert got.item() == want.item() and (L2.grad.item(), R2.grad.item()) == (L1.grad.item(), R1.grad.item())
    assert device.lam is None  # the state waits for end_step, after the step's one host read
    device.end_step(loss, [int(lam)])
    assert (device.lam, device.state.lam_switches, device.state.last_loss) == (host.lam, host.state.lam_switches, loss)


@pytest.mark.parametrize(("loss", "size"), [(2.0, 1100), (1.0, 550)])  # both gaps 0.5; both 0
def test_equal_gaps_choose_the_task_loss(loss, size):
    """A tie is not a size gap larger than the task gap: lambda is 0 on the host and on the device."""
    ctl = RankController(ControllerConfig(late_stage_step=0, target_ratio=0.5, target_loss=1.0))
    ctl.advance(0, global_loss=4.0, global_size=1100)  # S* = 550
    assert ctl.decide_lambda(loss, size) == 0
    L, R = _losses()
    out, lam = ctl.objective_on_device(L, R, global_loss=_f64(loss), global_size=_f64(size))
    assert not lam and out.item() == pytest.approx(0.1 * 2.0 + 0.01 * 0.8 + 2.0)


def test_early_objective_on_the_device_has_no_lambda():
    ctl = RankController(ControllerConfig(gamma=0.05))
    L, R = _losses()
    out, lam = ctl.objective_on_device(L, R, global_loss=_f64(float("nan")), global_size=None)  # S unused early
    assert lam is None and out.item() == pytest.approx(2.0 + 0.05 * 0.8)
    late = RankController(ControllerConfig(late_stage_step=0))
    late.begin_step(0, lambda: 100)
    with pytest.raises(RuntimeError, match="the late stage needs its target size and S"):
        late.objective_on_device(L, R, global_loss=_f64(2.0), global_size=None)


def test_begin_step_switches_by_step_exactly_and_reads_s_only_then():
    ctl = RankController(ControllerConfig(late_stage_step=3, target_ratio=0.25))
    reads = []

    def read_size() -> int:
        reads.append(800)
        return 800

    assert [ctl.begin_step(s, read_size) for s in (1, 2, 3, 4)] == [False, False, True, False]
    assert reads == [800]  # one host read of S in the run: on the step that switches
    assert (ctl.state.step, ctl.state.switch_step, ctl.state.target_size) == (4, 3, 200.0)


def test_begin_step_switches_by_loss_one_step_after_the_loss_crossed():
    """The loss criterion compares the step before's global loss (``end_step``): none before the first step."""
    ctl = RankController(ControllerConfig(late_stage_loss=1.5))
    assert not ctl.begin_step(1, lambda: 100)  # no loss measured yet
    ctl.end_step(1.6, [])
    assert not ctl.begin_step(2, lambda: 100)
    ctl.end_step(1.5, [])  # step 2's loss reaches the threshold ...
    assert ctl.begin_step(3, lambda: 90)  # ... so step 3 is the first late one
    assert (ctl.state.switch_step, ctl.state.size_at_switch) == (3, 90)
    with pytest.raises(RanksCollapsed, match=r"model size S = 0"):
        RankController(ControllerConfig(late_stage_step=0)).begin_step(0, lambda: 0)


def test_end_step_counts_lambda_switches_across_micro_batches_and_steps():
    ctl = RankController(ControllerConfig(late_stage_step=0, target_loss=1.0))
    ctl.begin_step(0, lambda: 1000)
    ctl.end_step(2.0, [0, 1])
    ctl.end_step(2.0, [1, 1, 0])
    assert (ctl.lam, ctl.state.lam_switches, ctl.state.last_loss) == (0, 2, 2.0)


def test_a_state_saved_before_last_loss_existed_loads():
    ctl = RankController(ControllerConfig(late_stage_loss=1.0))
    ctl.end_step(0.5, [])
    old = {k: v for k, v in ctl.state_dict().items() if k != "last_loss"}
    other = RankController(ctl.cfg)
    other.load_state_dict(old)
    assert other.state.last_loss is None and not other.begin_step(1, lambda: 10)  # no loss known: no switch
    with pytest.raises(ValueError, match=r"missing keys \['lam'\]"):
        other.load_state_dict({k: v for k, v in ctl.state_dict().items() if k != "lam"})


def test_bf16_losses_are_combined_in_fp32():
    """A bf16 task loss and penalty (DeepSpeed bf16) are combined in fp32, not rounded again to bf16:
    2 + 0.05 * 0.80078125 = 2.0400390625 would round to 2.046875 in bf16."""
    L, R = torch.tensor(2.0, dtype=torch.bfloat16), torch.tensor(0.8, dtype=torch.bfloat16)
    r = float(R)  # 0.80078125, the bf16 value of 0.8
    early = RankController(ControllerConfig(gamma=0.05)).objective(L, R, global_loss=2.0, global_size=1000)
    assert early.dtype == torch.float32 and early.item() == pytest.approx(2.0 + 0.05 * r, abs=1e-6)
    late = RankController(ControllerConfig(late_stage_step=0, target_ratio=0.5, target_loss=1.0))
    late.advance(0, global_loss=4.0, global_size=1000)
    out, lam = late.objective_on_device(L, R, global_loss=_f64(4.0), global_size=_f64(1000.0))  # lambda 0
    assert not lam and out.dtype == torch.float32
    assert out.item() == pytest.approx(0.1 * 2.0 + 0.01 * r + 2.0, abs=1e-6)


def test_a_zero_global_loss_is_refused_before_lambda_divides_by_it():
    """lambda's task gap (L - L*)/L divides by L: a zero global loss is a clear error at ``advance``."""
    ctl = RankController(ControllerConfig(late_stage_step=0))
    with pytest.raises(ValueError, match=r"global_loss must be finite and > 0, got 0.0"):
        ctl.advance(0, global_loss=0.0, global_size=10)
    ctl.advance(0, global_loss=1.0, global_size=10)
    with pytest.raises(ValueError, match=r"global_loss must be finite and > 0, got 0.0"):
        ctl.decide_lambda(0.0, 10)


def test_advance_records_the_step_it_was_given():
    """``state.step`` (checkpointed) is the last step passed to ``advance``, in either stage."""
    ctl = RankController(ControllerConfig(late_stage_step=2))
    for step in (0, 1, 2, 5):
        ctl.advance(step, global_loss=3.0, global_size=100)
        assert ctl.state.step == step
    assert ctl.state_dict()["step"] == 5 and ctl.state.switch_step == 2


@pytest.mark.parametrize(("step", "loss", "kept"), [(5, None, "is 5"), (None, None, "sets none"), (3, None, None),
                                                    (2, None, None), (9, 0.5, None)])
def test_a_resumed_late_stage_says_when_the_config_would_not_have_switched(step, loss, kept):
    """A stage is state: a resume whose ``late_stage_step`` is later (or unset) keeps the late stage, and says so;
    with a ``late_stage_loss`` the switch may have been the loss's, and nothing is said."""
    ctl = RankController(ControllerConfig(late_stage_step=3))
    assert ctl.stage_kept() is None  # early
    ctl.advance(3, global_loss=2.0, global_size=100)
    resumed = RankController(ControllerConfig(late_stage_step=step, late_stage_loss=loss))
    resumed.load_state_dict(ctl.state_dict())
    said = resumed.stage_kept()
    if kept is None:
        assert said is None
    else:
        assert said.startswith("the checkpoint's controller entered the late stage at step 3 and stays there: "
                               f"this config's comera.controller.late_stage_step {kept}, but a resume does not "
                               "undo a stage"), said
