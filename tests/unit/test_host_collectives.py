"""Blocking collectives on host tensors over a group whose backend takes device tensors only (NCCL).

ZenFlow sums its column norms of an offloaded gradient on the host; an NCCL group refuses a CPU tensor, so the
blocking collectives stage such a tensor through the accelerator and copy the result back. Here the backend name is
patched to ``nccl`` and the "accelerator" is the CPU, so the staging copy is a distinct host tensor the test can see.
"""

from __future__ import annotations

import pytest
import torch

from deepspeed._core.comm import collectives


@pytest.mark.parametrize(
    ("backend", "carries"),
    [("gloo", True), ("mpi", True), ("fake", True), ("cpu:gloo,cuda:nccl", True), ("nccl", False), ("hccl", False)],
)
def test_which_backends_take_host_tensors(backend: str, carries: bool) -> None:
    assert collectives.carries_host_tensors(backend) is carries


@pytest.mark.parametrize("verb", ["sum", "max", "broadcast"])
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_a_host_tensor_travels_through_the_accelerator_only_where_the_backend_needs_it(
    monkeypatch: pytest.MonkeyPatch, verb: str, backend: str
) -> None:
    seen: list[torch.Tensor] = []

    def collective(tensor: torch.Tensor, *args: object, **kwargs: object) -> None:
        seen.append(tensor)
        tensor.add_(10.0)  # what the other ranks would contribute

    monkeypatch.setattr(collectives.dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(collectives.dist, "all_reduce", collective)
    monkeypatch.setattr(collectives.dist, "broadcast", collective)
    host = torch.arange(4, dtype=torch.float32)
    if verb == "sum":
        collectives.sum_over(host, None)
    elif verb == "max":
        collectives.max_over(host, None)
    else:
        collectives.broadcast_tensor(host, 0, None)
    assert len(seen) == 1
    assert (seen[0] is host) is (backend == "gloo")  # staged as a copy for NCCL, in place for gloo
    torch.testing.assert_close(host, torch.arange(4, dtype=torch.float32) + 10.0)  # the result came back
