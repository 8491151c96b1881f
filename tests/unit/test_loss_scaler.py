"""fp16 loss scalers: the dynamic rule, the static scaler, the factory, and checkpoint pickling."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from deepspeed._core.config.plan import LossScalePolicy
from deepspeed._core.optim import loss_scaling
from deepspeed.runtime.fp16 import loss_scaler as facade
from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler, DynamicLossScaler, LossScaler, LossScalerBase

FACADE = "deepspeed.runtime.fp16.loss_scaler"


def _run(scaler: DynamicLossScaler, overflows: str) -> list[float]:
    """Feed a pattern ("x" overflow, "." clean) and return the scale after each update."""
    seen = []
    for ch in overflows:
        scaler.update_scale(ch == "x")
        seen.append(scaler.cur_scale)
    return seen


def test_constants_and_names() -> None:
    assert (facade.INITIAL_LOSS_SCALE, facade.SCALE_WINDOW, facade.DELAYED_SHIFT) == (
        "init_scale", "scale_window", "delayed_shift")  # fmt: skip
    assert (facade.CONSECUTIVE_HYSTERESIS, facade.MIN_LOSS_SCALE) == ("consecutive_hysteresis", "min_scale")
    assert issubclass(DynamicLossScaler, LossScalerBase) and issubclass(LossScaler, LossScalerBase)
    s = DynamicLossScaler()
    assert (s.cur_scale, s.scale_factor, s.scale_window, s.min_scale, s.delayed_shift) == (2**32, 2.0, 1000, 1, 1)
    assert s.dynamic is True and s.dtype == torch.half and s.loss_scale == 2**32
    assert LossScaler().cur_scale == 1 and LossScaler(8).dynamic is False


def test_overflow_halves_scale_without_hysteresis() -> None:
    s = DynamicLossScaler(init_scale=1024, scale_window=100)
    assert _run(s, "xxx") == [512, 256, 128]
    assert s.last_overflow_iter == 2 and s.cur_iter == 3


def test_hysteresis_two_first_overflow_keeps_scale_second_halves() -> None:
    s = DynamicLossScaler(init_scale=1024, scale_window=100, delayed_shift=2)
    s.update_scale(True)
    assert s.cur_scale == 1024 and s.cur_hysteresis == 1
    s.update_scale(True)
    assert s.cur_scale == 512 and s.cur_hysteresis == 1
    s.update_scale(True)  # hysteresis stays spent until the scale grows again
    assert s.cur_scale == 256


def test_hysteresis_is_refilled_only_on_growth_unless_consecutive() -> None:
    s = DynamicLossScaler(init_scale=64, scale_window=3, delayed_shift=3)
    _run(s, "x.x")
    assert s.cur_hysteresis == 1 and s.cur_scale == 64
    c = DynamicLossScaler(init_scale=64, scale_window=3, delayed_shift=3, consecutive_hysteresis=True)
    _run(c, "x.x")
    assert c.cur_hysteresis == 2 and c.cur_scale == 64  # refilled by the clean step in between
    _run(s, "....")  # stable window reached: grows and refills
    assert s.cur_scale == 128 and s.cur_hysteresis == 3


def test_window_growth_timing() -> None:
    s = DynamicLossScaler(init_scale=8, scale_window=3)
    # From the start the window counts cur_iter itself: growth when cur_iter reaches 3, then every 3.
    assert _run(s, ".......") == [8, 8, 8, 16, 16, 16, 32]
    # After an overflow the step right after it does not count: growth 3 + 1 clean steps later.
    s2 = DynamicLossScaler(init_scale=8, scale_window=3)
    assert _run(s2, "x....") == [4, 4, 4, 4, 8]


def test_custom_scale_factor() -> None:
    s = DynamicLossScaler(init_scale=81, scale_factor=3.0, scale_window=1)
    assert _run(s, "x..") == [27, 27, 81]


def test_min_scale_floor_and_raise() -> None:
    s = DynamicLossScaler(init_scale=6, min_scale=4, raise_error_at_min_scale=False)
    assert _run(s, "xx") == [4, 4]  # clamped to the floor, then stays there
    r = DynamicLossScaler(init_scale=6, min_scale=4)
    r.update_scale(True)
    with pytest.raises(Exception, match="Current loss scale already at minimum"):
        r.update_scale(True)


def test_static_scaler_never_changes() -> None:
    s = LossScaler(scale=128)
    for overflow in (True, False, True):
        s.update_scale(overflow)
    assert s.cur_scale == 128 and s.loss_scale == 128
    assert s.has_overflow([]) is False and LossScaler._has_inf_or_nan(torch.tensor([float("inf")])) is False


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_inf_nan_detection(dtype: torch.dtype) -> None:
    detect = DynamicLossScaler._has_inf_or_nan
    assert not detect(torch.ones(8, dtype=dtype))
    for bad in (float("inf"), -float("inf"), float("nan")):
        x = torch.ones(8, dtype=dtype)
        x[3] = bad
        assert detect(x), (dtype, bad)


def test_large_finite_values_are_not_overflow() -> None:
    # A sum of these overflows fp16, but every element is finite.
    assert not DynamicLossScaler._has_inf_or_nan(torch.full((64,), 60000.0, dtype=torch.float16))


def test_has_overflow_serial_checks_param_grads() -> None:
    a, b, c = (torch.nn.Parameter(torch.zeros(3)) for _ in range(3))
    a.grad = torch.ones(3)
    s = DynamicLossScaler()
    assert s.has_overflow_serial([a, b, c]) is False  # params without grads are skipped
    c.grad = torch.tensor([0.0, float("nan"), 1.0])
    assert s.has_overflow_serial([a, b, c]) is True


def test_backward_and_scale_gradient_apply_the_scale() -> None:
    w = torch.nn.Parameter(torch.tensor([2.0, 3.0]))
    s = LossScaler(scale=8)
    s.backward((w * w).sum())
    assert torch.equal(w.grad, 8 * 2 * w.detach())
    assert torch.equal(s.scale_loss(torch.tensor(1.5)), torch.tensor(12.0))
    out = DynamicLossScaler(init_scale=4).scale_gradient(None, (torch.ones(2), None), ())
    assert torch.equal(out[0], torch.full((2,), 4.0)) and out[1] is None


def test_create_loss_scaler_factory() -> None:
    args = {"init_scale": 2**16, "scale_window": 500, "delayed_shift": 2, "consecutive_hysteresis": True,
            "min_scale": 0.5}  # fmt: skip
    dyn = CreateLossScaler(torch.half, 0, True, args)
    assert isinstance(dyn, DynamicLossScaler)
    assert (dyn.cur_scale, dyn.scale_window, dyn.delayed_shift, dyn.cur_hysteresis, dyn.min_scale) == (
        2**16, 500, 2, 2, 0.5)  # fmt: skip
    assert dyn.consecutive_hysteresis is True and dyn.dtype == torch.half
    static = CreateLossScaler(torch.half, 128.0, False, None)
    assert type(static) is LossScaler and static.cur_scale == 128.0
    for other in (torch.bfloat16, torch.float32):
        s = CreateLossScaler(other, 128.0, True, args)
        assert type(s) is LossScaler and s.cur_scale == 1.0
    with pytest.raises(AssertionError, match="Dynamic loss scaling parameters must be defined"):
        CreateLossScaler(torch.half, 0, True, None)
    with pytest.raises(ValueError, match=r"dynamic_loss_args\['scale_window'\]"):
        CreateLossScaler(torch.half, 0, True, dict(args, scale_window=0))
    with pytest.raises(ValueError, match="fp16.loss_scale"):
        CreateLossScaler(torch.half, float("inf"), False, None)


def test_from_policy() -> None:
    dyn = loss_scaling.from_policy(LossScalePolicy(initial_scale_power=12, scale_window=50, hysteresis=3,
                                                   consecutive_hysteresis=True, min_scale=2.0))  # fmt: skip
    assert isinstance(dyn, DynamicLossScaler)
    assert (dyn.cur_scale, dyn.scale_window, dyn.delayed_shift, dyn.min_scale) == (4096, 50, 3, 2.0)
    assert dyn.consecutive_hysteresis is True
    static = loss_scaling.from_policy(LossScalePolicy(dynamic=False, static_scale=64.0))
    assert type(static) is LossScaler and static.cur_scale == 64.0


# --------------------------------------------------------------------------------------------------
# pickling: checkpoints carry these objects
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [lambda: DynamicLossScaler(init_scale=64, scale_window=2, delayed_shift=2),
                                  lambda: LossScaler(32)])  # fmt: skip
def test_pickle_records_facade_path_and_round_trips(make) -> None:
    s = make()
    blob = pickle.dumps(s)
    assert FACADE.encode() in blob and b"deepspeed._core" not in blob
    restored = pickle.loads(blob)
    assert type(restored) is type(s) and restored.__dict__ == s.__dict__


def test_restored_dynamic_scaler_continues_the_same_schedule() -> None:
    s = DynamicLossScaler(init_scale=64, scale_window=2, delayed_shift=2)
    _run(s, "x..x")
    buf = io.BytesIO()
    torch.save({"loss_scaler": s}, buf)
    buf.seek(0)
    restored = torch.load(buf, weights_only=False)["loss_scaler"]
    pattern = "...x.x..x...."
    assert _run(restored, pattern) == _run(s, pattern)


def _pickle_as_upstream(monkeypatch: pytest.MonkeyPatch, name: str, attrs: dict) -> bytes:
    """Bytes an upstream checkpoint holds: a plain object of class ``<FACADE>.<name>`` with ``attrs``."""
    stand_in = type(name, (), {"__module__": FACADE})
    obj = stand_in.__new__(stand_in)
    obj.__dict__.update(attrs)
    # pickle checks the class is reachable at its recorded path; point the path at the stand-in briefly.
    monkeypatch.setattr(facade, name, stand_in)
    blob = pickle.dumps(obj)
    monkeypatch.undo()
    return blob


UPSTREAM_DYNAMIC_ATTRS = {
    "cur_scale": 1024.0, "dynamic": True, "cur_iter": 10, "last_overflow_iter": 7, "scale_factor": 2.0,
    "scale_window": 4, "min_scale": 1, "delayed_shift": 2, "cur_hysteresis": 1, "consecutive_hysteresis": False,
    "raise_error_at_min_scale": True, "dtype": torch.float16,
}  # fmt: skip


def test_unpickles_upstream_dynamic_scaler(monkeypatch: pytest.MonkeyPatch) -> None:
    blob = _pickle_as_upstream(monkeypatch, "DynamicLossScaler", UPSTREAM_DYNAMIC_ATTRS)
    s = pickle.loads(blob)
    assert type(s) is DynamicLossScaler and s.loss_scale == 1024.0
    s.update_scale(True)  # hysteresis already spent in the checkpoint: halves at once
    assert s.cur_scale == 512.0 and s.last_overflow_iter == 10


def test_unpickles_upstream_static_scaler(monkeypatch: pytest.MonkeyPatch) -> None:
    blob = _pickle_as_upstream(monkeypatch, "LossScaler", {"cur_scale": 16, "dynamic": False})
    s = pickle.loads(blob)
    assert type(s) is LossScaler and s.loss_scale == 16


def test_unpickles_old_checkpoint_missing_newer_attributes(monkeypatch: pytest.MonkeyPatch) -> None:
    old = {k: v for k, v in UPSTREAM_DYNAMIC_ATTRS.items() if k not in ("raise_error_at_min_scale", "dtype", "dynamic")}
    s = pickle.loads(_pickle_as_upstream(monkeypatch, "DynamicLossScaler", dict(old, cur_hysteresis=2)))
    assert s.raise_error_at_min_scale is True and s.dtype == torch.half and s.dynamic is True
    s.update_scale(True)
    assert s.cur_scale == 1024.0 and s.cur_hysteresis == 1
