"""Flatten / unflatten on CPU: the front end's torch path and the built utils op's C++ path.

The CUDA kernel's tests live in test_cuda_kernels.py (marked gpu).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from deepspeed.ops import flatten as front

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
POISON = 0x5A


class _Impl:
    """One implementation under test: flatten_into(tensors, out, offsets) and unflatten_from(flat, tensors, offsets)."""

    def __init__(self, flatten_into: Callable, unflatten_from: Callable) -> None:
        self.flatten_into = flatten_into
        self.unflatten_from = unflatten_from


@pytest.fixture(params=["torch_front_end", "native_cpu"])
def impl(request: pytest.FixtureRequest) -> _Impl:
    if request.param == "torch_front_end":
        return _Impl(front.flatten_into, front.unflatten_from)
    op: ModuleType = request.getfixturevalue("utils_op")
    return _Impl(op.flatten_into, op.unflatten_from)


def _poisoned(n: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(n, dtype=dtype)
    out.view(torch.uint8).fill_(POISON)
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _roundtrip(impl: _Impl, sizes: list[int], dtype: torch.dtype, gaps: list[int], misalign: int = 0) -> None:
    tensors = [torch.randn(n + misalign).to(dtype)[misalign:] for n in sizes]
    offsets, nxt = [], 0
    for t, gap in zip(tensors, gaps, strict=True):
        nxt += gap
        offsets.append(nxt)
        nxt += t.numel()
    out = _poisoned(nxt + 3, dtype)
    expected = out.clone()
    for t, off in zip(tensors, offsets, strict=True):
        expected[off : off + t.numel()] = t
    impl.flatten_into(tensors, out, offsets)
    assert torch.equal(_bits(out), _bits(expected)), "flatten_into wrote the wrong bytes (or touched the gaps)"
    back = [_poisoned(t.numel(), dtype) for t in tensors]
    impl.unflatten_from(out, back, offsets)
    for i, (t, b) in enumerate(zip(tensors, back, strict=True)):
        assert torch.equal(_bits(t), _bits(b)), f"unflatten_from mismatch at tensor {i}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_sizes_and_empty(impl: _Impl, dtype: torch.dtype) -> None:
    sizes = [1, 0, 3, 17, 1023, 0, 4099, 7]
    _roundtrip(impl, sizes, dtype, gaps=[0] * len(sizes))


@pytest.mark.parametrize("dtype", DTYPES)
def test_offsets_with_gaps_and_misaligned_sources(impl: _Impl, dtype: torch.dtype) -> None:
    sizes = [5, 33, 129, 1, 1000]
    _roundtrip(impl, sizes, dtype, gaps=[1, 3, 0, 7, 2], misalign=1)


def test_many_small_tensors(impl: _Impl) -> None:
    rng = random.Random(5)
    sizes = [rng.randint(0, 9) for _ in range(2000)]
    _roundtrip(impl, sizes, torch.bfloat16, gaps=[rng.randint(0, 2) for _ in sizes])


def test_default_offsets_are_packed(impl: _Impl) -> None:
    tensors = [torch.randn(3, 2), torch.randn(0), torch.randn(5)]
    out = torch.zeros(11)
    impl.flatten_into(tensors, out)
    assert torch.equal(out, torch.cat([t.reshape(-1) for t in tensors]))


def test_errors(impl: _Impl) -> None:
    out = torch.zeros(100)
    with pytest.raises(ValueError, match="not contiguous"):
        impl.flatten_into([torch.randn(4, 4).t()], out, [0])
    with pytest.raises(ValueError, match="dtype"):
        impl.flatten_into([torch.randn(4, dtype=torch.float64)], out, [0])
    with pytest.raises(ValueError, match="does not fit"):
        impl.flatten_into([torch.randn(4)], out, [97])
    with pytest.raises(ValueError, match="does not fit"):
        impl.flatten_into([torch.randn(4)], out, [-1])
    with pytest.raises(ValueError, match="offsets"):
        impl.flatten_into([torch.randn(4)], out, [0, 4])
    with pytest.raises(ValueError, match="contiguous"):
        impl.unflatten_from(out[::2], [torch.randn(4)], [0])
    with pytest.raises(ValueError, match="mixed devices"):
        impl.flatten_into([torch.empty(4, device="meta")], out, [0])


def test_compat_flatten_unflatten(utils_op: ModuleType) -> None:
    tensors = [torch.randn(3, 5), torch.randn(7), torch.randn(0), torch.randn(2, 2, 2).transpose(0, 2)]
    flat = utils_op.flatten(tensors)
    assert torch.equal(flat, torch._utils._flatten_dense_tensors(tensors))
    views = utils_op.unflatten(flat, tensors)
    assert [v.shape for v in views] == [t.shape for t in tensors]
    assert all(torch.equal(v, t) for v, t in zip(views, tensors, strict=True))
    assert not utils_op.has_cuda_kernel() or torch.version.cuda is not None


def test_front_end_logs_fallback_once(caplog: pytest.LogCaptureFixture) -> None:
    from deepspeed.utils.logging import logger

    front._logged.clear()
    logger.propagate = True
    try:
        with caplog.at_level("INFO", logger=logger.name):
            for _ in range(3):
                front.flatten_into([torch.ones(2)], torch.zeros(2))
    finally:
        logger.propagate = False
    assert sum("torch implementation" in r.getMessage() for r in caplog.records) == 1
