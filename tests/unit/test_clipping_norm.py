"""``local_sq_norm``: the fp32 sum of squares of mixed-dtype gradients, upcast through one reused buffer."""

from __future__ import annotations

import pytest
import torch

from deepspeed._core.optim import clipping
from deepspeed._core.optim.clipping import local_sq_norm


@pytest.mark.parametrize("chunk", [5, 64, 1000, clipping.NORM_CHUNK_NUMEL])
def test_matches_a_float64_reference_across_dtypes_and_blocks(chunk: int, monkeypatch) -> None:
    monkeypatch.setattr(clipping, "NORM_CHUNK_NUMEL", chunk)
    monkeypatch.setattr(clipping, "HOST_NORM_BLOCK_NUMEL", 7)  # many blocks, ragged ends
    gen = torch.Generator().manual_seed(3)
    grads = [
        torch.randn(n, generator=gen).to(dtype)
        for n, dtype in [
            (1, torch.bfloat16),
            (23, torch.float16),
            (100, torch.float32),
            (64, torch.bfloat16),
            (0, torch.float16),
        ]
    ]
    expected = sum(float((g.double() ** 2).sum()) for g in grads)
    got = local_sq_norm(grads)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert float(got) == pytest.approx(expected, rel=1e-6)


def test_empty_and_nonfinite() -> None:
    assert float(local_sq_norm([])) == 0.0
    g = torch.ones(10, dtype=torch.bfloat16)
    g[3] = float("inf")
    assert float(local_sq_norm([g])) == float("inf")
    g[3] = float("nan")
    assert torch.isnan(local_sq_norm([torch.ones(2), g]))


def test_one_upcast_buffer_for_every_piece(monkeypatch) -> None:
    """No fresh host tensor per piece: every narrow piece is copied into the same scratch storage."""
    monkeypatch.setattr(clipping, "HOST_NORM_BLOCK_NUMEL", 4)
    seen: set[int] = set()
    real_dot = torch.dot

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.dtype == torch.float32 and a.numel() <= 4:
            seen.add(a.untyped_storage().data_ptr())
        return real_dot(a, b)

    monkeypatch.setattr(torch, "dot", spy)
    local_sq_norm([torch.randn(10).bfloat16(), torch.randn(9).half()])
    assert len(seen) == 1


@pytest.mark.gpu
def test_gradients_on_two_devices_are_reduced_where_they_live(monkeypatch) -> None:
    """Host and device gradients in one call: each device reduces its own (no device tensor is upcast through a
    host buffer); the sum is on the first gradient's device."""
    from deepspeed.accelerator import get_accelerator

    device = torch.device(get_accelerator().current_device_name())
    host = [torch.randn(50).bfloat16(), torch.randn(7)]
    on_device = [torch.randn(1000).bfloat16().to(device), torch.randn(300).half().to(device)]
    grads = [host[0], *on_device, host[1]]
    expected = sum(float((g.double() ** 2).sum()) for g in grads)
    dot_devices: list[str] = []
    real_dot = torch.dot

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        dot_devices.append(a.device.type)
        return real_dot(a, b)

    monkeypatch.setattr(torch, "dot", spy)
    monkeypatch.setattr(clipping, "NORM_CHUNK_NUMEL", 64)
    got = local_sq_norm(grads)
    assert got.device.type == "cpu" and float(got) == pytest.approx(expected, rel=1e-5)
    assert dot_devices.count(device.type) >= len(on_device)  # device pieces were dotted on the device


@pytest.mark.parametrize("block", [7, 1000])
def test_batched_small_pieces_match_the_reference(block: int, monkeypatch) -> None:
    """[Note: batched norm]: pieces up to one block are reduced by one multi-tensor norm (forced here on the host),
    larger ones by the blocked loop; the sum, infinities and nans are those of the float64 reference."""
    monkeypatch.setattr(clipping, "_batches_on", lambda device: True)
    monkeypatch.setattr(clipping, "HOST_NORM_BLOCK_NUMEL", block)
    calls: list[int] = []
    real = torch._foreach_norm

    def spy(pieces, *args, **kwargs):
        calls.append(len(pieces))
        return real(pieces, *args, **kwargs)

    monkeypatch.setattr(torch, "_foreach_norm", spy)
    gen = torch.Generator().manual_seed(5)
    sizes = [(3, torch.bfloat16), (7, torch.float16), (50, torch.float32), (900, torch.bfloat16), (1, torch.float32)]
    grads = [torch.randn(n, generator=gen).to(dtype) for n, dtype in sizes]
    expected = sum(float((g.double() ** 2).sum()) for g in grads)
    got = local_sq_norm(grads)
    assert got.dtype == torch.float32 and float(got) == pytest.approx(expected, rel=1e-6)
    assert calls == [sum(1 for n, _ in sizes if n <= block)]
    grads[0][1] = float("inf")
    assert float(local_sq_norm(grads)) == float("inf")
    grads[0][1] = float("nan")
    assert torch.isnan(local_sq_norm(grads))
