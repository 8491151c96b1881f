"""CUDA correctness checks of the native ops, as plain functions (no pytest needed).

Used by ``tests/kernels/test_cuda_kernels.py`` (pytest, marked ``gpu``) and by
``benchmarks/kernels/bench_ops.py`` (which runs them before timing). Every check draws fresh random
data, writes into poisoned buffers and compares bit-exactly (copies) or against torch (Adam).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
POISON_BYTE = 0xA5


def _utils():
    from deepspeed.ops.op_builder import UtilsBuilder

    module = UtilsBuilder().load()
    assert module.has_cuda_kernel(), "utils op was built without the CUDA kernel"
    return module


def _rand(n: int, dtype: torch.dtype, device: str, misalign: int = 0) -> torch.Tensor:
    """Contiguous random tensor whose start is ``misalign`` elements past an allocation start."""
    base = torch.randn(n + misalign, device=device, dtype=torch.float32).to(dtype)
    return base[misalign:]


def _poisoned(n: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    out = torch.empty(n, dtype=dtype, device=device)
    out.view(torch.uint8).fill_(POISON_BYTE)
    return out


def _expected_flat(tensors: list[torch.Tensor], offsets: list[int], out: torch.Tensor) -> torch.Tensor:
    expected = out.clone()
    for t, off in zip(tensors, offsets, strict=True):
        expected[off : off + t.numel()] = t.reshape(-1)
    return expected


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _roundtrip(
    sizes: list[int], dtype: torch.dtype, device: str, gap: Callable[[int], int], misalign: Callable[[int], int]
) -> None:
    m = _utils()
    tensors = [_rand(n, dtype, device, misalign(i)) for i, n in enumerate(sizes)]
    offsets, nxt = [], 0
    for i, t in enumerate(tensors):
        nxt += gap(i)
        offsets.append(nxt)
        nxt += t.numel()
    out = _poisoned(nxt + 5, dtype, device)
    expected = _expected_flat(tensors, offsets, out)
    m.flatten_into(tensors, out, offsets)
    torch.cuda.synchronize()
    assert _same_bits(out, expected), f"flatten_into mismatch ({dtype}, {len(sizes)} tensors)"
    targets = [_poisoned(t.numel(), dtype, device) for t in tensors]
    m.unflatten_from(out, targets, offsets)
    torch.cuda.synchronize()
    for i, (t, back) in enumerate(zip(tensors, targets, strict=True)):
        assert _same_bits(t, back), f"unflatten_from mismatch at tensor {i} ({dtype})"


def check_every_dtype(device: str = "cuda") -> None:
    """Odd sizes, empty tensors, every floating dtype (fp32, fp16, bf16, fp64), packed offsets."""
    sizes = [1, 0, 3, 17, 1023, 0, 65537, 7, 300001]
    for dtype in DTYPES:
        _roundtrip(sizes, dtype, device, gap=lambda i: 0, misalign=lambda i: 0)


def check_misaligned(device: str = "cuda") -> None:
    """Odd gaps in the flat buffer and sources starting at odd element addresses (the shifted path)."""
    sizes = [5, 4099, 131071, 33, 262147, 1, 8]
    for dtype in DTYPES:
        _roundtrip(sizes, dtype, device, gap=lambda i: (3 * i + 1) % 7, misalign=lambda i: i % 5)


def check_many_mixed(device: str = "cuda") -> None:
    """1000 tensors of log-uniform mixed sizes (0 to ~1M elements) in bf16 and fp32."""
    rng = random.Random(1234)
    sizes = [0 if rng.random() < 0.02 else int(10 ** rng.uniform(0, 6)) for _ in range(1000)]
    for dtype in (torch.bfloat16, torch.float32):
        _roundtrip(sizes, dtype, device, gap=lambda i: i % 3, misalign=lambda i: i % 2)


def check_many_small(device: str = "cuda") -> None:
    """5000 tiny tensors (1 to 9 elements)."""
    sizes = [1 + i % 9 for i in range(5000)]
    _roundtrip(sizes, torch.float16, device, gap=lambda i: 0, misalign=lambda i: 0)


def check_compat_flatten(device: str = "cuda") -> None:
    """``flatten`` matches ``torch._utils._flatten_dense_tensors``; ``unflatten`` gives views of the right shapes."""
    m = _utils()
    tensors = [torch.randn(s, device=device) for s in [(3, 5), (7,), (0,), (2, 2, 2)]]
    flat = m.flatten(tensors)
    assert torch.equal(flat, torch._utils._flatten_dense_tensors(tensors))
    views = m.unflatten(flat, tensors)
    assert all(torch.equal(a, b) for a, b in zip(views, tensors, strict=True))


def _expect_value_error(fn: Callable[[], object], needle: str) -> None:
    try:
        fn()
    except ValueError as err:
        assert needle in str(err), f"error {err!s} does not mention {needle!r}"
        return
    raise AssertionError(f"expected a ValueError mentioning {needle!r}")


def check_errors(device: str = "cuda") -> None:
    """Non-contiguous, mixed-device, mixed-dtype and out-of-range inputs raise ValueError.

    Checked through the ``deepspeed.ops.flatten`` front-end, which validates before launching. The raw
    extension's own C++ checks are not exercised here: on the H200 image (torch 2.11, g++ 13.3) a
    ``c10::ValueError`` thrown inside the JIT-built module crashed the process instead of reaching
    Python (seen 2026-11-29; docs/ops.md, "Known issues").
    """
    from deepspeed.ops import flatten as front

    out = torch.zeros(100, device=device)
    _expect_value_error(lambda: front.flatten_into([torch.randn(4, 4, device=device).t()], out, [0]), "not contiguous")
    _expect_value_error(lambda: front.flatten_into([torch.randn(4)], out, [0]), "mixed devices")
    _expect_value_error(
        lambda: front.flatten_into([torch.randn(4, device=device, dtype=torch.half)], out, [0]), "dtype"
    )
    _expect_value_error(lambda: front.flatten_into([torch.randn(4, device=device)], out, [97]), "does not fit")
    _expect_value_error(lambda: front.unflatten_from(out[::2], [torch.randn(4, device=device)], [0]), "contiguous")


def check_front_end(device: str = "cuda") -> None:
    """``deepspeed.ops.flatten`` uses the kernel on CUDA and gives the same bits as torch."""
    from deepspeed.ops import flatten as front

    tensors = [torch.randn(n, device=device, dtype=torch.bfloat16) for n in (5, 0, 1000, 77)]
    out = _poisoned(2000, torch.bfloat16, device)
    offsets = [3, 10, 11, 1500]
    expected = _expected_flat(tensors, offsets, out)
    front.flatten_into(tensors, out, offsets)
    assert front._cuda_kernel() is not None, "front end did not load the CUDA kernel"
    assert _same_bits(out, expected)
    back = [torch.empty_like(t) for t in tensors]
    front.unflatten_from(out, back, offsets)
    assert all(_same_bits(a, b) for a, b in zip(tensors, back, strict=True))


def _reference_lowp_step(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    step: int,
    adam_w_mode: bool,
    wd: float,
    lr: float = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
) -> None:
    """The kernel's contract for 16-bit storage: fp32 math, states and params rounded on store."""
    p32, g32, m32, v32 = p.float(), g.float(), m.float(), v.float()
    if not adam_w_mode:
        g32 = g32 + wd * p32
    m32 = b1 * m32 + (1 - b1) * g32
    v32 = b2 * v32 + (1 - b2) * g32 * g32
    denom = v32.sqrt() / (1 - b2**step) ** 0.5 + eps
    if adam_w_mode:
        p32 = p32 * (1 - lr * wd)
    p32 = p32 - (lr / (1 - b1**step)) * (m32 / denom)
    p.copy_(p32)
    m.copy_(m32)
    v.copy_(v32)


def _check_adam_case(dtype: torch.dtype, adam_w_mode: bool, wd: float, device: str) -> float:
    from deepspeed.ops.adam import FusedAdam

    sizes = [1, 3, 4096, 16385, 100003, 5]
    ours = [torch.nn.Parameter(torch.randn(n, device=device).to(dtype)) for n in sizes]
    opt = FusedAdam(ours, lr=1e-3, weight_decay=wd, adam_w_mode=adam_w_mode)
    if dtype == torch.float32:
        ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        ref_opt = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(ref, lr=1e-3, weight_decay=wd, foreach=False)
    else:
        ref = [p.detach().clone() for p in ours]
        moments = [(torch.zeros_like(r), torch.zeros_like(r)) for r in ref]
    for step in range(1, 51):
        grads = [torch.randn(p.shape, device=device).to(dtype) for p in ours]
        for p, g in zip(ours, grads, strict=True):
            p.grad = g
        opt.step()
        if dtype == torch.float32:
            for r, g in zip(ref, grads, strict=True):
                r.grad = g.clone()
            ref_opt.step()
        else:
            for r, g, (m, v) in zip(ref, grads, moments, strict=True):
                _reference_lowp_step(r, g, m, v, step, adam_w_mode, wd)
    return max(
        ((p.detach().float() - r.detach().float()).abs().max() / r.detach().float().abs().max()).item()
        for p, r in zip(ours, ref, strict=True)
    )


def check_fused_adam(device: str = "cuda") -> None:
    """FusedAdam's kernel against torch Adam/AdamW (fp32) or a fp32-math reference (16-bit), 50 steps."""
    from deepspeed.ops.adam import fused_adam

    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
    for dtype, adam_w_mode, wd in [
        (torch.float32, True, 0.01),
        (torch.float32, False, 0.01),
        (torch.float32, True, 0.0),
        (torch.bfloat16, True, 0.01),
        (torch.float16, False, 0.01),
    ]:
        err = _check_adam_case(dtype, adam_w_mode, wd, device)
        assert fused_adam._kernel_state["module"] is not None, "FusedAdam did not use the CUDA kernel"
        assert err < tolerance[dtype], f"FusedAdam {dtype} adamw={adam_w_mode} wd={wd}: rel err {err:.3g}"


def check_fused_adam_found_inf(device: str = "cuda") -> None:
    """FusedAdam with a device ``found_inf`` flag: 1 leaves parameters and moments as they were, 0 steps exactly
    as without a flag; the optimizer declares it (``skips_on_found_inf``)."""
    from deepspeed.ops.adam import FusedAdam

    params = [torch.nn.Parameter(torch.randn(n, device=device)) for n in (7, 5000)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, twin_opt = FusedAdam(params, lr=1e-2), FusedAdam(twins, lr=1e-2)
    assert opt.skips_on_found_inf()
    for flag in (0.0, 1.0, 0.0):
        grads = [torch.randn_like(p) for p in params]
        for p, t, g in zip(params, twins, grads, strict=True):
            p.grad, t.grad = g.clone(), g.clone()
        before = [p.detach().clone() for p in params]
        moments = [opt.state[p]["exp_avg"].clone() for p in params] if opt.state else None
        opt.found_inf = torch.tensor(flag, device=device)
        opt.step()
        del opt.found_inf
        if flag:
            assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True)), "found_inf=1 must skip"
            assert moments is not None and all(
                torch.equal(opt.state[p]["exp_avg"], m) for p, m in zip(params, moments, strict=True)
            )
            for p in params:  # the caller's part: the step count goes back
                opt.state[p]["step"] -= 1
        else:
            twin_opt.step()
            assert all(torch.equal(p, t) for p, t in zip(params, twins, strict=True)), "found_inf=0 must step"


ALL_CHECKS: tuple[Callable[[str], None], ...] = (
    check_every_dtype,
    check_misaligned,
    check_many_mixed,
    check_many_small,
    check_compat_flatten,
    check_errors,
    check_front_end,
    check_fused_adam,
    check_fused_adam_found_inf,
)
