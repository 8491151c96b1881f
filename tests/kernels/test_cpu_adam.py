"""DeepSpeedCPUAdam (native SIMD/OpenMP kernel and the pure-torch fallback) against torch Adam/AdamW."""

from __future__ import annotations

import itertools

import pytest
import torch

from deepspeed.ops.adam import DeepSpeedCPUAdam

SIZES = (10007, 3, 1, 64)
STEPS = 100
RTOL = 1e-6
FP64_RTOL = 1e-5


def _reference_fp64(
    params: list[torch.Tensor],
    grads: list[list[torch.Tensor]],
    lr: float,
    wd: float,
    adamw: bool,
    bias_correction: bool,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> list[torch.Tensor]:
    """Textbook Adam/AdamW in float64 (used where torch has no switch, e.g. bias_correction=False)."""
    out = []
    for i, p0 in enumerate(params):
        p, m, v = (
            p0.double().clone(),
            torch.zeros_like(p0, dtype=torch.float64),
            torch.zeros_like(p0, dtype=torch.float64),
        )
        for t, step_grads in enumerate(grads, start=1):
            g = step_grads[i].double()
            if not adamw:
                g = g + wd * p
            m = betas[0] * m + (1 - betas[0]) * g
            v = betas[1] * v + (1 - betas[1]) * g * g
            bc1 = 1 - betas[0] ** t if bias_correction else 1.0
            bc2 = 1 - betas[1] ** t if bias_correction else 1.0
            if adamw:
                p = p * (1 - lr * wd)
            p = p - (lr / bc1) * m / (v.sqrt() / bc2**0.5 + eps)
        out.append(p)
    return out


def _run_ours(
    params: list[torch.Tensor], grads: list[list[torch.Tensor]], native: bool, **kw: object
) -> list[torch.Tensor]:
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = DeepSpeedCPUAdam(ps, **kw)
    if not native:
        opt.ds_opt_adam = None
    for step_grads in grads:
        for p, g in zip(ps, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps]


def _run_torch(
    params: list[torch.Tensor], grads: list[list[torch.Tensor]], adamw: bool, lr: float, wd: float
) -> list[torch.Tensor]:
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)(ps, lr=lr, weight_decay=wd, foreach=False)
    for step_grads in grads:
        for p, g in zip(ps, step_grads, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps]


def _data(seed: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(seed)
    params = [torch.randn(n, generator=gen) for n in SIZES]
    grads = [[torch.randn(n, generator=gen) for n in SIZES] for _ in range(STEPS)]
    return params, grads


def _assert_rel(ours: list[torch.Tensor], ref: list[torch.Tensor], rtol: float) -> None:
    for a, b in zip(ours, ref, strict=True):
        b = b.to(a.dtype)
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err <= rtol, f"relative error {err:.3g} > {rtol}"


CASES = list(itertools.product([True, False], [0.0, 0.01], [True, False]))


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch_fallback"])
@pytest.mark.parametrize("adamw,wd,bias_correction", CASES)
def test_cpu_adam_matches_reference(
    request: pytest.FixtureRequest, native: bool, adamw: bool, wd: float, bias_correction: bool
) -> None:
    if native:
        request.getfixturevalue("cpu_adam_op")
    params, grads = _data(seed=7)
    lr = 1e-3
    ours = _run_ours(params, grads, native, lr=lr, weight_decay=wd, adamw_mode=adamw, bias_correction=bias_correction)
    kw = {"lr": lr, "weight_decay": wd, "adamw_mode": adamw, "bias_correction": bias_correction}
    if bias_correction:
        _assert_rel(ours, _run_torch(params, grads, adamw, lr, wd), RTOL)
    elif native:
        # torch has no bias_correction switch: the fallback runs torch's own ops in torch's order.
        _assert_rel(ours, _run_ours(params, grads, False, **kw), RTOL)
    # fp32 rounding of p * (1 - lr * wd) drifts ~3e-6 from float64 over 100 steps in torch itself.
    _assert_rel(ours, _reference_fp64(params, grads, lr, wd, adamw, bias_correction), FP64_RTOL)


# fp16 moments with eps=1e-8 underflow to inf/nan (as in torch), so fp16 runs with fp32 states only.
@pytest.mark.parametrize("dtype,fp32_states", [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, True)])
def test_cpu_adam_low_precision_params(cpu_adam_op: object, dtype: torch.dtype, fp32_states: bool) -> None:
    params, grads = _data(seed=3)
    params = [p.to(dtype) for p in params]
    grads = [[g.to(dtype) for g in gs] for gs in grads[:20]]
    kw = {"lr": 1e-3, "weight_decay": 0.01, "fp32_optimizer_states": fp32_states}
    native = _run_ours(params, grads, True, **kw)
    fallback = _run_ours(params, grads, False, **kw)
    assert all(p.dtype == dtype for p in native)
    _assert_rel(native, fallback, 2e-2 if dtype == torch.bfloat16 else 2e-3)
    ref = _reference_fp64(
        [p.float() for p in params], [[g.float() for g in gs] for gs in grads], 1e-3, 0.01, True, True
    )
    _assert_rel(native, ref, 3e-2 if dtype == torch.bfloat16 else 5e-3)


def test_cpu_adam_bf16_stores_round_like_torch(cpu_adam_op: object) -> None:
    """The native kernel's bf16 stores are torch's rounding to the bit (nearest-even, NaN canonical, inf kept).

    With lr 0 the parameter comes back unchanged, and after one step from zero moments the moments are single fp32
    products of the gradient, m = (1 - beta1)·g and v = (1 - beta2)·g², so torch computes the same fp32 values and
    rounds them with its own conversion. One million random values cross many rounding ties.
    """
    gen = torch.Generator().manual_seed(11)
    g = (torch.randn(1 << 20, generator=gen) * torch.exp(torch.randn(1 << 20, generator=gen) * 4)).bfloat16()
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 3.0e38], dtype=torch.bfloat16)
    p = torch.nn.Parameter(torch.cat([g, specials]))
    before = p.detach().clone()
    p.grad = torch.cat([g, torch.ones(len(specials), dtype=torch.bfloat16)])
    opt = DeepSpeedCPUAdam([p], lr=0.0, betas=(0.9, 0.999), fp32_optimizer_states=False)
    opt.step()
    state = opt.state[p]
    assert state["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(p.detach().view(torch.int16), before.view(torch.int16).where(~before.isnan(), 0x7FC0))
    gf = p.grad.float()
    one_minus_beta1 = torch.tensor(1.0 - 0.9, dtype=torch.float32)
    one_minus_beta2 = torch.tensor(1.0 - 0.999, dtype=torch.float32)
    assert torch.equal(state["exp_avg"].view(torch.int16), (one_minus_beta1 * gf).bfloat16().view(torch.int16))
    assert torch.equal(
        state["exp_avg_sq"].view(torch.int16), (one_minus_beta2 * (gf * gf)).bfloat16().view(torch.int16)
    )


def test_cpu_adam_state_layout_and_reload(cpu_adam_op: object) -> None:
    p = torch.nn.Parameter(torch.randn(33, dtype=torch.bfloat16))
    opt = DeepSpeedCPUAdam([p], lr=1e-2)
    p.grad = torch.randn_like(p)
    opt.step()
    state = opt.state[p]
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and state["step"] == 1
    assert state["exp_avg"].dtype == torch.float32
    saved = opt.state_dict()
    fresh = DeepSpeedCPUAdam([p], lr=1e-2)
    fresh.load_state_dict(saved)
    assert fresh.state[p]["exp_avg"].dtype == torch.float32
    assert torch.equal(fresh.state[p]["exp_avg_sq"], state["exp_avg_sq"])


def test_cpu_adam_step_subgroup_only_touches_that_group(cpu_adam_op: object) -> None:
    a, b = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8))
    opt = DeepSpeedCPUAdam([{"params": [a]}, {"params": [b]}], lr=0.1)
    a.grad, b.grad = torch.ones(8), torch.ones(8)
    before = b.detach().clone()
    opt.step_subgroup(0)
    assert torch.equal(b.detach(), before) and opt.state[a]["step"] == 1 and b not in opt.state


def test_cpu_adam_kernel_rejects_bad_input(cpu_adam_op: object) -> None:
    opt = DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(4))])
    p, g = torch.zeros(8), torch.zeros(8)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_adam_op.adam_update(
            opt.opt_id, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, p, g, torch.zeros(4, 4).t(), torch.zeros(16)
        )
    with pytest.raises(ValueError, match="elements"):
        cpu_adam_op.adam_update(opt.opt_id, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, p, g, torch.zeros(7), torch.zeros(8))
    with pytest.raises(ValueError, match="not created"):
        cpu_adam_op.adam_update(10**6, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, p, g, torch.zeros(8), torch.zeros(8))


def test_cpu_adam_amsgrad_raises() -> None:
    with pytest.raises(ValueError, match="amsgrad"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("coef", [1.0, 0.37])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam_l2"])
def test_scaled_step_is_the_long_route_bit_for_bit(
    cpu_adam_op: object, grad_dtype: torch.dtype, coef: float, adamw: bool
) -> None:
    """step_scaled (gradient in its own dtype, scaled on load, rounded copy written in the same pass) gives the
    bits of: convert the gradient to fp32, multiply it by ``coef``, step, round the parameter into the copy."""
    gen = torch.Generator().manual_seed(5)
    n = 10007
    start = torch.randn(n, generator=gen)
    long_p, scaled_p = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    kw = {"lr": 1e-3, "weight_decay": 0.05, "adamw_mode": adamw}
    long_opt, scaled_opt = DeepSpeedCPUAdam([long_p], **kw), DeepSpeedCPUAdam([scaled_p], **kw)
    for _ in range(3):
        grad = (torch.randn(n, generator=gen) * 3).to(grad_dtype)
        long_p.grad = grad.float() * coef if coef != 1.0 else grad.float()
        long_opt.step()
        copy = torch.full((n,), float("nan"), dtype=torch.bfloat16)
        assert scaled_opt.step_scaled(grad, coef, copy)
        assert torch.equal(scaled_p, long_p)
        assert torch.equal(copy, long_p.detach().bfloat16())
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(scaled_opt.state[scaled_p][key], long_opt.state[long_p][key])
    assert scaled_opt.state[scaled_p]["step"] == 3


def test_scaled_step_declines_what_it_cannot_do(cpu_adam_op: object) -> None:
    """A bf16 parameter with fp32 states, an fp16 gradient or fp32 copy for a bf16 parameter, an fp16 parameter, or
    the torch fallback: ``False``, nothing changed."""
    p = torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))
    mixed = DeepSpeedCPUAdam([p], fp32_optimizer_states=True)
    assert not mixed.step_scaled(torch.ones(8, dtype=torch.bfloat16))
    bf16 = DeepSpeedCPUAdam([torch.nn.Parameter(torch.randn(8, dtype=torch.bfloat16))], fp32_optimizer_states=False)
    assert not bf16.step_scaled(torch.ones(8, dtype=torch.float16))
    assert not bf16.step_scaled(torch.ones(8, dtype=torch.bfloat16), 1.0, torch.empty(8))
    half = DeepSpeedCPUAdam([torch.nn.Parameter(torch.randn(8, dtype=torch.float16))], fp32_optimizer_states=False)
    assert not half.step_scaled(torch.ones(8, dtype=torch.float16))
    q = torch.nn.Parameter(torch.randn(8))
    fallback = DeepSpeedCPUAdam([q])
    fallback.ds_opt_adam = None
    assert not fallback.step_scaled(torch.ones(8))
    assert not mixed.state and not bf16.state and not half.state and not fallback.state


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("coef", [1.0, 0.37])
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam_l2"])
def test_scaled_step_with_16_bit_states_is_the_fp32_step_rounded_once(
    cpu_adam_op: object, grad_dtype: torch.dtype, coef: float, adamw: bool
) -> None:
    """A bf16 parameter with bf16 moments: each step's bits are those of the fp32 scaled step on the same values
    (the bf16 parameter and moments widened exactly), its parameter and moments then rounded to bf16 once."""
    gen = torch.Generator().manual_seed(11)
    n = 10007
    kw = {"lr": 1e-3, "weight_decay": 0.05, "adamw_mode": adamw}
    p16 = torch.nn.Parameter(torch.randn(n, generator=gen).bfloat16())
    opt16 = DeepSpeedCPUAdam([p16], fp32_optimizer_states=False, **kw)
    for step in range(1, 4):
        grad = (torch.randn(n, generator=gen) * 3).to(grad_dtype)
        # The fp32 form on the same values, from this step's bf16 state.
        p32 = torch.nn.Parameter(p16.detach().float())
        opt32 = DeepSpeedCPUAdam([p32], **kw)
        if step > 1:
            opt32.state[p32] = {
                "step": step - 1,
                **{k: opt16.state[p16][k].float() for k in ("exp_avg", "exp_avg_sq")},
            }
        assert opt32.step_scaled(grad, coef)
        copy = torch.full((n,), float("nan"), dtype=torch.bfloat16)
        assert opt16.step_scaled(grad, coef, copy)
        assert p16.dtype == torch.bfloat16 and opt16.state[p16]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(p16.detach(), p32.detach().bfloat16())
        assert torch.equal(copy, p16.detach())
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt16.state[p16][key], opt32.state[p32][key].bfloat16())
    assert opt16.state[p16]["step"] == 3


def test_chunked_step_with_16_bit_states_takes_the_scaled_route(cpu_adam_op: object) -> None:
    """A bf16 master with bf16 moments, stepped through chunk views: every chunk in the kernel's one pass (no
    conversion buffer), the same bits as one scaled step over the whole master."""
    from deepspeed._core.optim.chunked_step import ChunkStepper

    gen = torch.Generator().manual_seed(13)
    start = torch.randn(1000, generator=gen).bfloat16()
    grads = [torch.randn(1000, generator=gen).bfloat16() for _ in range(3)]
    whole = torch.nn.Parameter(start.clone(), requires_grad=False)
    whole_opt = DeepSpeedCPUAdam([whole], lr=1e-2, weight_decay=0.01, fp32_optimizer_states=False)
    master = torch.nn.Parameter(start.clone(), requires_grad=False)
    opt = DeepSpeedCPUAdam([master], lr=1e-2, weight_decay=0.01, fp32_optimizer_states=False)
    copy = torch.empty(1000, dtype=torch.bfloat16)
    for grad in grads:
        assert whole_opt.step_scaled(grad, 0.5)
        stepper = ChunkStepper(opt, 0, 300)
        for lo, hi in stepper.ranges():
            stepper.step_range(lo, hi, grad, 0.5, copy_out=copy[lo:hi])
        assert stepper.convert is None  # no range went the long way
        stepper.close()
        assert torch.equal(master, whole) and torch.equal(copy, whole.detach())
    for key in ("exp_avg", "exp_avg_sq"):
        assert opt.state[master][key].dtype == torch.bfloat16
        assert torch.equal(opt.state[master][key], whole_opt.state[whole][key])


def test_chunked_step_takes_the_scaled_route(cpu_adam_op: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stepped through chunk views, the host Adam takes each chunk's bf16 gradient as it is (no fp32 conversion
    buffer) and writes the rounded copy; the result is the long route's, bit for bit."""
    from deepspeed._core.optim.chunked_step import ChunkStepper

    gen = torch.Generator().manual_seed(9)
    start = torch.randn(1000, generator=gen)
    grads = [torch.randn(1000, generator=gen).bfloat16() for _ in range(3)]

    def run(scaled: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        master = torch.nn.Parameter(start.clone(), requires_grad=False)
        opt = DeepSpeedCPUAdam([master], lr=1e-2, weight_decay=0.01)
        calls = []
        if scaled:
            real = opt.step_scaled
            monkeypatch.setattr(opt, "step_scaled", lambda *a: calls.append(1) or real(*a))
        else:
            monkeypatch.setattr(opt, "step_scaled", None, raising=False)
        copy = torch.empty(1000, dtype=torch.bfloat16)
        for grad in grads:
            stepper = ChunkStepper(opt, 0, 300)
            for lo, hi in stepper.ranges():
                stepper.step_range(lo, hi, grad, 0.5, copy_out=copy[lo:hi])
            assert (stepper.convert is None) == scaled  # the long route converts into its buffer
            stepper.close()
        return master.detach(), copy, len(calls)

    scaled_master, scaled_copy, calls = run(True)
    long_master, long_copy, _ = run(False)
    assert calls == 3 * 4
    assert torch.equal(scaled_master, long_master)
    assert torch.equal(scaled_copy, long_copy) and torch.equal(scaled_copy, long_master.bfloat16())


def test_fp16_loads_and_stores_convert_like_torch(cpu_adam_op: object) -> None:
    """The kernel's fp16 conversions (raw 16 bits, vectorised) give torch's values for every fp16 bit pattern on
    load and round every kind of fp32 value to the nearest even fp16 on store (overflow to infinity, subnormals,
    ties); NaN stays NaN.

    With lr 0 the parameter comes back unchanged where its gradient is finite, and the rounded copy is compared with
    torch's conversion of the parameter the kernel left; after one
    step from zero moments, exp_avg is (1 - beta1) times the loaded gradient, a single fp32 product.
    """
    every = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    gen = torch.Generator().manual_seed(13)
    wide = torch.randn(1 << 20, generator=gen) * torch.exp2(torch.randint(-30, 20, (1 << 20,), generator=gen))
    ties = torch.arange(1 << 14, dtype=torch.float32) * 2.0**-24 + 2.0**-25  # halfway between subnormals
    specials = torch.tensor(
        [
            65504.0,
            65519.99,
            65520.0,
            65536.0,
            1e9,
            float("inf"),
            float("-inf"),
            float("nan"),
            -0.0,
            0.0,
            2.0**-14,
            2.0**-24,
            2.0**-25,
            3 * 2.0**-26,
            6.1e-5,
        ]
    )
    params = torch.cat([every.float().nan_to_num(0.0), wide, ties, -ties, specials])
    grads = torch.cat([every, torch.zeros(len(params) - len(every), dtype=torch.float16)])
    p = torch.nn.Parameter(params.clone())
    opt = DeepSpeedCPUAdam([p], lr=0.0, betas=(0.9, 0.999))
    copy = torch.empty(len(params), dtype=torch.float16)
    assert opt.step_scaled(grads, 1.0, copy)
    finite = grads.float().isfinite()  # lr 0 leaves these unchanged (a NaN or infinite gradient poisons its own)
    torch.testing.assert_close(p.detach()[finite], params[finite], rtol=0, atol=0, equal_nan=True)
    want_copy = p.detach().half()
    nan = want_copy.isnan()
    assert torch.equal(copy.isnan(), nan)
    assert torch.equal(copy[~nan].view(torch.int16), want_copy[~nan].view(torch.int16))
    loaded = opt.state[p]["exp_avg"][: len(every)]
    want = torch.tensor(1.0 - 0.9, dtype=torch.float32) * every.float()
    torch.testing.assert_close(loaded, want, rtol=0, atol=0, equal_nan=True)


def test_scaled_step_names_a_copy_buffer_that_does_not_fit(cpu_adam_op: object) -> None:
    """Refused before anything changes: the parameter, its state and its step count stay as they were."""
    p = torch.nn.Parameter(torch.randn(16))
    before = p.detach().clone()
    opt = DeepSpeedCPUAdam([p])
    grad = torch.ones(16, dtype=torch.bfloat16)
    for bad in (torch.empty(8, dtype=torch.bfloat16), torch.empty(16, dtype=torch.int32)):
        with pytest.raises(ValueError, match="copy_out must be a contiguous CPU tensor of 16 elements"):
            opt.step_scaled(grad, 1.0, bad)
    assert not opt.state[p] and torch.equal(p.detach(), before)


def test_updates_run_without_the_gil(cpu_adam_op: object) -> None:
    """A step called from a host worker thread leaves the training thread free to run Python (its autograd hooks)
    while the kernel works: the training thread makes progress inside the kernel's calls."""
    import sys
    import threading
    import time

    n = 1 << 24
    p = torch.nn.Parameter(torch.zeros(n))
    opt = DeepSpeedCPUAdam([p], lr=1e-3)
    grad = torch.full((n,), 1e-3, dtype=torch.bfloat16)
    copy = torch.empty(n, dtype=torch.bfloat16)
    assert opt.step_scaled(grad, 1.0, copy)  # the state exists: the timed calls below are the update alone
    windows: list[tuple[float, float]] = []
    started, done = threading.Event(), threading.Event()

    def worker() -> None:
        started.set()
        for _ in range(3):
            t0 = time.perf_counter()
            opt.step_scaled(grad, 1.0, copy)
            windows.append((t0, time.perf_counter()))
        done.set()

    stamps: list[float] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # a thread holding the GIL in Python hands it over within 0.1 ms
    try:
        thread = threading.Thread(target=worker)
        thread.start()
        started.wait()
        while not done.is_set():
            stamps.append(time.perf_counter())
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    inside = [s for t0, t1 in windows for s in stamps if t0 + 0.3 * (t1 - t0) < s < t1 - 0.3 * (t1 - t0)]
    assert inside, f"the training thread never ran during the kernel's calls {windows}"
