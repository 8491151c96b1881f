"""Learning-rate schedules against their closed-form definitions (deepspeed.runtime.lr_schedules)."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from deepspeed.runtime import lr_schedules as ls
from deepspeed.runtime.lr_schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR


def _sgd(lr: float = 0.5, groups: int = 1) -> torch.optim.SGD:
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]} for _ in range(groups)]
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def _adamw(lr: float = 0.5) -> torch.optim.AdamW:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr, betas=(0.95, 0.999))


def _lr(opt: torch.optim.Optimizer) -> float:
    return opt.param_groups[0]["lr"]


def _log_warm(lo: float, hi: float, t: int, w: int) -> float:
    return lo + (hi - lo) * math.log(t + 1) / math.log(w) if t < w else hi


def _lin_warm(lo: float, hi: float, t: int, w: int) -> float:
    return lo + (hi - lo) * t / w if t < w else hi


# --------------------------------------------------------------------------------------------------
# names and helpers
# --------------------------------------------------------------------------------------------------


def test_valid_schedule_names_and_key_constants() -> None:
    assert ls.VALID_LR_SCHEDULES == ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    assert (ls.WARMUP_MIN_LR, ls.WARMUP_MAX_LR, ls.WARMUP_NUM_STEPS, ls.WARMUP_TYPE) == (
        "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type")  # fmt: skip
    assert (ls.WARMUP_LOG_RATE, ls.WARMUP_LINEAR_RATE, ls.TOTAL_NUM_STEPS) == ("log", "linear", "total_num_steps")
    assert ls.LR_SCHEDULE == "lr_schedule" and ls.COS_MIN_RATIO == "cos_min_ratio"
    assert ls.CYCLE_MAX_LR == "cycle_max_lr" and ls.LR_RANGE_TEST_MIN_LR == "lr_range_test_min_lr"


def test_tuning_arguments_feed_config_from_args() -> None:
    parser = ls.add_tuning_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--lr_schedule", "WarmupLR", "--warmup_num_steps", "50", "--warmup_type", "linear"])
    config, err = ls.get_config_from_args(args)
    assert err is None
    assert config == {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 50, "warmup_type": "linear"},
    }
    assert ls.get_lr_from_config(config) == (0.001, "")

    one_cycle, _ = ls.get_config_from_args(parser.parse_args(["--lr_schedule", "OneCycle"]))
    assert one_cycle["params"]["cycle_max_lr"] == 0.1 and one_cycle["params"]["cycle_first_stair_count"] == -1
    assert ls.get_lr_from_config(one_cycle) == (0.1, "")


def test_config_helpers_report_problems() -> None:
    none_cfg, err = ls.get_config_from_args(argparse.Namespace(lr_schedule=None))
    assert none_cfg is None and "--lr_schedule not specified" in err
    bad_cfg, err = ls.get_config_from_args(argparse.Namespace(lr_schedule="Nope"))
    assert bad_cfg is None and "Nope" in err
    assert ls.get_lr_from_config({"params": {}})[0] is None
    assert ls.get_lr_from_config({"type": "WarmupLR"})[0] is None
    assert ls.get_lr_from_config({"type": "Bogus", "params": {}}) == (None, "Bogus is not a valid LR schedule")
    assert ls.get_lr_from_config({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 0.02}}) == (0.02, "")


def test_wrapped_optimizer_is_unwrapped_and_junk_rejected() -> None:
    opt = _sgd()

    class Wrapper:
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optimizer = inner

    sched = WarmupLR(Wrapper(opt), warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=4)
    assert sched.optimizer is opt and _lr(opt) == pytest.approx(0.01)
    with pytest.raises(TypeError, match="not a subclass of torch.optim.Optimizer"):
        WarmupLR(object())


# --------------------------------------------------------------------------------------------------
# WarmupLR / WarmupDecayLR
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("warmup_type, shape", [("log", _log_warm), ("linear", _lin_warm)])
def test_warmup_lr_follows_its_formula(warmup_type: str, shape) -> None:
    opt = _sgd()
    sched = WarmupLR(opt, warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type=warmup_type)
    assert _lr(opt) == pytest.approx(0.01)  # a fresh schedule writes its starting lr at once
    assert sched.get_last_lr() == [pytest.approx(0.01)]
    for t in range(25):
        sched.step()
        assert sched.last_batch_iteration == t
        assert _lr(opt) == pytest.approx(shape(0.01, 0.1, t, 10), rel=1e-12)
        assert sched.get_last_lr() == [_lr(opt)]
    assert _lr(opt) == pytest.approx(0.1)


def test_warmup_log_and_linear_differ_mid_warmup() -> None:
    a, b = _sgd(), _sgd()
    log_s = WarmupLR(a, 0.0, 1.0, 100, "log")
    lin_s = WarmupLR(b, 0.0, 1.0, 100, "linear")
    log_s.step(9)
    lin_s.step(9)
    assert _lr(a) == pytest.approx(math.log(10) / math.log(100)) and _lr(b) == pytest.approx(0.09)


def test_warmup_max_lr_defaults_to_optimizer_lr_and_unknown_type_falls_back_to_log() -> None:
    opt = _sgd(lr=0.3)
    sched = WarmupLR(opt, warmup_num_steps=4, warmup_type="cubic")
    assert sched.warmup_type == "log" and sched.max_lrs == [0.3]
    sched.step(2)
    assert _lr(opt) == pytest.approx(0.3 * math.log(3) / math.log(4))


def test_warmup_steps_clamped_to_two() -> None:
    opt = _sgd()
    sched = WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=1)
    assert sched.warmup_num_steps == 2
    sched.step()
    assert _lr(opt) == 0.0  # log(1) / log(2)
    sched.step()
    assert _lr(opt) == 1.0


@pytest.mark.parametrize("bad", [0, -3, 2.5, "10", None, True])
@pytest.mark.parametrize("cls", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_warmup_num_steps_must_be_positive_int(cls: str, bad) -> None:
    ctor = {
        "WarmupLR": lambda n: WarmupLR(_sgd(), warmup_num_steps=n),
        "WarmupDecayLR": lambda n: WarmupDecayLR(_sgd(), 100, warmup_num_steps=n),
        "WarmupCosineLR": lambda n: WarmupCosineLR(_sgd(), 100, warmup_num_steps=n),
    }[cls]
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
        ctor(bad)


def test_per_group_lists_must_match_group_count() -> None:
    opt = _sgd(groups=2)
    sched = WarmupLR(opt, warmup_min_lr=[0.0, 0.1], warmup_max_lr=[1.0, 2.0], warmup_num_steps=10, warmup_type="linear")
    sched.step(5)
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.5), pytest.approx(1.05)]
    with pytest.raises(ValueError, match="warmup_min_lr"):
        WarmupLR(opt, warmup_min_lr=[0.0, 0.1, 0.2])
    with pytest.raises(ValueError, match="lr_range_test_min_lr"):
        LRRangeTest(opt, lr_range_test_min_lr=[0.1])


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_decay_lr_decays_linearly_to_min(warmup_type: str) -> None:
    opt = _sgd()
    lo, hi, w, total = 0.002, 0.2, 5, 25
    sched = WarmupDecayLR(opt, total, warmup_min_lr=lo, warmup_max_lr=hi, warmup_num_steps=w, warmup_type=warmup_type)
    shape = _log_warm if warmup_type == "log" else _lin_warm
    for t in range(total + 10):
        sched.step()
        if t < w:
            expected = shape(lo, hi, t, w)
        else:
            expected = lo + (hi - lo) * max(0.0, (total - t) / (total - w))
        assert _lr(opt) == pytest.approx(expected, rel=1e-12), t
    assert _lr(opt) == pytest.approx(lo)
    sched.step(w)
    assert _lr(opt) == pytest.approx(hi)  # decay starts from the peak exactly at the warmup boundary
    sched.step(total)
    assert _lr(opt) == pytest.approx(lo)


def test_warmup_decay_default_peak_is_one_thousandth() -> None:
    opt = _sgd(lr=5.0)
    sched = WarmupDecayLR(opt, total_num_steps=100, warmup_num_steps=10)
    sched.step(10)
    assert _lr(opt) == pytest.approx(0.001)  # peak at the end of warmup, whatever the optimizer lr


# --------------------------------------------------------------------------------------------------
# WarmupCosineLR
# --------------------------------------------------------------------------------------------------


def _cosine_ratio(t: int, w: int, total: int, wmin: float, cmin: float, warmup_type: str) -> float:
    if t < w:
        g = math.log(t + 1) / math.log(w) if warmup_type == "log" else t / w
        return wmin + g * (1 - wmin)
    p = min(1.0, (t - w + 1) / max(1, total - w))
    return cmin + (1 - cmin) * (1 + math.cos(math.pi * p)) / 2


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_cosine_lr_follows_its_formula(warmup_type: str) -> None:
    opt = _sgd(lr=0.5)
    w, total, wmin, cmin = 4, 20, 0.1, 0.01
    sched = WarmupCosineLR(opt, total, warmup_min_ratio=wmin, warmup_num_steps=w, cos_min_ratio=cmin,
                           warmup_type=warmup_type)  # fmt: skip
    assert _lr(opt) == 0.0  # ratio 0 before training starts
    for t in range(total + 8):
        sched.step()
        assert _lr(opt) == pytest.approx(0.5 * _cosine_ratio(t, w, total, wmin, cmin, warmup_type), rel=1e-12), t
    assert _lr(opt) == pytest.approx(0.5 * cmin)  # holds at the floor past the end
    sched.step(total - 1)
    assert sched.get_lr_ratio() == pytest.approx(cmin)


def test_warmup_cosine_ratios_are_relative_to_each_groups_initial_lr() -> None:
    opt = _sgd(groups=2)
    opt.param_groups[1]["lr"] = 0.1
    sched = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=2, warmup_type="linear")
    sched.step(2)  # first post-warmup step: p = 1/8
    ratio = 0.0001 + 0.9999 * (1 + math.cos(math.pi / 8)) / 2
    assert [g["lr"] for g in opt.param_groups] == [pytest.approx(0.5 * ratio), pytest.approx(0.1 * ratio)]


# --------------------------------------------------------------------------------------------------
# OneCycle
# --------------------------------------------------------------------------------------------------


def _one_cycle_height(b: int, first: int, second: int, stairs1: int = 0, stairs2: int = 0) -> float:
    pos = b % (first + second)
    if pos <= first:
        return math.floor(pos * stairs1 / first) / stairs1 if stairs1 else pos / first
    rest = first + second - pos
    return math.floor(rest * stairs2 / second) / stairs2 if stairs2 else rest / second


def test_one_cycle_lr_and_momentum_through_all_phases() -> None:
    opt = _adamw()
    first, second, dss = 4, 6, 3
    sched = OneCycle(opt, cycle_min_lr=0.1, cycle_max_lr=1.0, decay_lr_rate=0.5, cycle_first_step_size=first,
                     cycle_second_step_size=second, decay_step_size=dss, cycle_min_mom=0.8, cycle_max_mom=0.9,
                     decay_mom_rate=0.1)  # fmt: skip
    assert _lr(opt) == 0.1 and opt.param_groups[0]["betas"] == (0.8, 0.99)
    for t in range(30):
        sched.step()
        if t < first + second:
            h = _one_cycle_height(t + 1, first, second)
            lr, mom = 0.1 + 0.9 * h, 0.9 - 0.1 * h
        else:
            d = (t - (first + second) + 1) / dss
            lr, mom = 0.1 / (1 + 0.5 * d), 0.9 * (1 + 0.1 * d)
        assert _lr(opt) == pytest.approx(lr, rel=1e-12), t
        assert opt.param_groups[0]["betas"][0] == pytest.approx(mom, rel=1e-12), t
        assert opt.param_groups[0]["betas"][1] == 0.99
    sched.step(first - 1)  # peak of the cycle
    assert _lr(opt) == pytest.approx(1.0) and opt.param_groups[0]["betas"][0] == pytest.approx(0.8)
    assert sched.get_mom() == [(pytest.approx(0.8), 0.99)]


def test_one_cycle_without_decay_holds_end_values() -> None:
    opt = _adamw()
    sched = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=2)
    sched.step(50)
    assert _lr(opt) == pytest.approx(0.01) and opt.param_groups[0]["betas"][0] == pytest.approx(0.9)


def test_one_cycle_staircase() -> None:
    opt = _adamw()
    sched = OneCycle(opt, 0.0, 1.0, cycle_first_step_size=4, cycle_second_step_size=6, cycle_first_stair_count=2,
                     cycle_second_stair_count=3)  # fmt: skip
    seen = []
    for t in range(10):
        sched.step()
        assert _lr(opt) == pytest.approx(_one_cycle_height(t + 1, 4, 6, 2, 3)), t
        seen.append(_lr(opt))
    assert seen[:4] == [0.0, 0.5, 0.5, 1.0]  # flat across each stair, and the peak is reached
    assert set(round(x, 9) for x in seen[4:]) <= {0.0, round(1 / 3, 9), round(2 / 3, 9)}


def test_one_cycle_second_stair_count_defaults_to_first() -> None:
    sched = OneCycle(_adamw(), 0.0, 1.0, cycle_first_step_size=4, cycle_first_stair_count=2)
    assert sched.second_stair_count == 2 and sched.second_step_size == 4.0


def test_one_cycle_momentum_disabled_for_optimizer_without_betas() -> None:
    opt = _sgd()
    sched = OneCycle(opt, 0.01, 0.1, cycle_first_step_size=2)
    assert sched.cycle_momentum is False and sched.get_mom() is None
    sched.step()
    assert opt.param_groups[0]["momentum"] == 0.9 and "betas" not in opt.param_groups[0]
    assert _lr(opt) == pytest.approx(0.055)


def test_one_cycle_validates_step_sizes() -> None:
    with pytest.raises(ValueError, match="cycle_first_step_size"):
        OneCycle(_adamw(), 0.01, 0.1, cycle_first_step_size=0)


# --------------------------------------------------------------------------------------------------
# LRRangeTest
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test(staircase: bool) -> None:
    opt = _sgd()
    sched = LRRangeTest(opt, lr_range_test_min_lr=0.01, lr_range_test_step_size=4, lr_range_test_step_rate=2.0,
                        lr_range_test_staircase=staircase)  # fmt: skip
    assert _lr(opt) == 0.01
    for t in range(20):
        sched.step()
        k = (t + 1) / 4
        k = math.floor(k) if staircase else k
        assert _lr(opt) == pytest.approx(0.01 * (1 + 2.0 * k), rel=1e-12), t
    if staircase:
        sched.step(5)
        flat = _lr(opt)
        sched.step(6)
        assert _lr(opt) == flat


def test_lr_range_test_validates_step_size() -> None:
    with pytest.raises(ValueError, match="lr_range_test_step_size"):
        LRRangeTest(_sgd(), lr_range_test_step_size=0)


# --------------------------------------------------------------------------------------------------
# state, resume, get_last_lr
# --------------------------------------------------------------------------------------------------

_FACTORIES = {
    "LRRangeTest": lambda o: LRRangeTest(o, 0.01, 3, 1.5, True),
    "OneCycle": lambda o: OneCycle(o, 0.01, 0.1, decay_lr_rate=0.3, cycle_first_step_size=3, decay_step_size=2),
    "WarmupLR": lambda o: WarmupLR(o, 0.0, 0.1, 6, "linear"),
    "WarmupDecayLR": lambda o: WarmupDecayLR(o, 15, 0.0, 0.1, 6),
    "WarmupCosineLR": lambda o: WarmupCosineLR(o, 15, 0.05, 4),
}


@pytest.mark.parametrize("name", sorted(_FACTORIES))
def test_state_dict_round_trip_resumes_the_same_sequence(name: str) -> None:
    make = _FACTORIES[name]
    ref_opt = _adamw()
    ref = make(ref_opt)
    for _ in range(7):
        ref.step()
    sd = ref.state_dict()
    assert sd == {"last_batch_iteration": 6}

    opt = _adamw()
    resumed = make(opt)
    resumed.load_state_dict(sd)
    for _ in range(12):
        ref.step()
        resumed.step()
        assert resumed.get_last_lr() == ref.get_last_lr()
        assert _lr(opt) == _lr(ref_opt) and opt.param_groups[0]["betas"] == ref_opt.param_groups[0]["betas"]


def test_get_last_lr_before_first_step_asserts_need_to_call_step() -> None:
    # A resumed schedule has written nothing yet; OneCycle never fills get_last_lr before a step.
    resumed = WarmupLR(_sgd(), warmup_num_steps=10, last_batch_iteration=5)
    with pytest.raises(AssertionError, match="need to call step"):
        resumed.get_last_lr()
    with pytest.raises(AssertionError, match="need to call step"):
        OneCycle(_adamw(), 0.01, 0.1).get_last_lr()
    resumed.step()
    assert resumed.last_batch_iteration == 6 and len(resumed.get_last_lr()) == 1


def test_tensor_lr_is_updated_in_place() -> None:
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.5))
    lr_tensor = opt.param_groups[0]["lr"]
    sched = WarmupCosineLR(opt, total_num_steps=10, warmup_num_steps=2, warmup_type="linear")
    sched.step(1)
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == pytest.approx(0.5 * 0.5)
    last = sched.get_last_lr()[0]
    sched.step(9)
    assert float(last) == pytest.approx(0.25)  # the returned value is a snapshot, not the live tensor
