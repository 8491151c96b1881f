"""ZeRO-3 gradient shards in small chunks: allocated as the backward reaches them, stepped chunk by chunk in
place, and numerically the same as the single-process reference ([Note: lazy grad shard])."""

from __future__ import annotations

import pytest
import torch

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch
from tests.reference.zero_oracle import engine_micro_index, reference_train

GAS = 2
CHUNK_BYTES = 64  # 16 fp32 elements per chunk: the tiny model's shard spans many chunks


def _train_tiny_chunks(world: int, offload: bool, direct: bool = False) -> dict:
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed._core.optim import chunked_step

    chunked_step.STEP_CHUNK_BYTES_MIN = CHUNK_BYTES
    chunked_step.STEP_CHUNK_BYTES_CAP = CHUNK_BYTES
    zero = {"stage": 3, "reduce_bucket_size": 100, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": zero,
    }
    engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
    opt = engine.optimizer
    submitted = {"direct": 0, "ring": 0}
    if direct:  # what page-locked chunks on a GPU machine do, on the CPU: every fold through the host path
        from deepspeed._core.comm.host_transfer import Staging

        opt.host.staging = Staging.ALWAYS
        for grp in opt.groups:
            grp.direct_first_fold = True
        real_direct, real_submit = opt.host.submit_direct, opt.host.submit

        def count(kind: str, fn):  # noqa: ANN001, ANN202
            def wrapped(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                submitted[kind] += 1
                return fn(*args, **kwargs)

            return wrapped

        opt.host.submit_direct, opt.host.submit = count("direct", real_direct), count("ring", real_submit)
    total = sum(g.master.numel() for g in opt.groups)
    samples: list[int] = []

    def allocated(param: object, state: object, grad: object) -> None:
        samples.append(sum(g.accumulator.allocated_numel for g in opt.groups if g.accumulator is not None))

    handle = engine.zero3_manager.on_grad_ready(allocated)
    first_backward: list[int] = []
    kept: list[list[int]] = []  # gradient chunk storage held after each step
    for step in range(3):
        for m in range(GAS):
            engine.backward(engine(*micro_batch(step, engine_micro_index(m, dist.get_rank(), world))))
            if not first_backward:
                first_backward = list(samples)
            engine.step()
        kept.append(
            sorted(
                c.data_ptr()
                for g in opt.groups
                if g.accumulator is not None
                for c in g.accumulator._chunks
                if c is not None
            )
        )
    handle.remove()
    chunk = opt._step_chunk_numel
    sd = engine._zero3_consolidated_16bit_state_dict()
    obj = [sd]
    dist.broadcast_object_list(obj, src=0)
    after = opt.live_grad_buffers()
    engine.destroy()
    return dict(
        first=first_backward,
        total=total,
        chunk=chunk,
        after=after,
        kept=kept,
        submitted=submitted,
        weights={k: v.float() for k, v in obj[0].items()},
    )


@pytest.mark.parametrize(
    "world,offload,direct", [(1, False, False), (2, False, False), (2, True, False), (2, True, True)]
)
def test_zero3_grad_shard_chunks_are_lazy_and_exact(world: int, offload: bool, direct: bool) -> None:
    results = run_distributed(_train_tiny_chunks, world, world, offload, direct)
    model = make_model(0)
    reference_train(model, 3, world, GAS, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01), clip=1.0)
    for r in results:
        assert r["chunk"] == CHUNK_BYTES // 4 and r["total"] > 4 * r["chunk"]
        first = r["first"]
        # Early in the first backward only the chunks reached so far exist; they only grow within it.
        assert first and first == sorted(first), first
        # Partly allocated at some point: a shard allocated whole at the first fold jumps from 0 to the total.
        assert any(0 < v < r["total"] for v in first), (first, r["total"])
        assert r["after"]["accumulators"] == 0
        if direct:  # first folds of a window copied straight in, the second micro-step's added via the ring
            assert r["submitted"]["direct"] > 0 and r["submitted"]["ring"] > 0, r["submitted"]
        if offload:  # host chunks keep their storage from step to step ([Note: kept host chunks])
            assert r["kept"][0] and r["kept"] == [r["kept"][0]] * 3, r["kept"]
        else:  # device chunks are all freed by the step
            assert r["kept"] == [[], [], []], r["kept"]
        for k, v in model.state_dict().items():
            rel = float((r["weights"][k] - v).norm() / v.norm())
            assert rel < 1e-5, f"{k}: {rel}"


def _reduce_inputs(world: int) -> dict:
    import deepspeed
    from deepspeed._core.comm import dist  # the module the reducer calls (deepspeed.comm re-exports it)

    model = make_model(0, vocab=38, hidden=24)  # 912-element embedding/head: no padding at world 2
    names = {id(p): name for name, p in model.named_parameters()}
    grad_ptrs: dict[str, int] = {}
    inputs: list[int] = []
    real = dist.reduce_scatter_tensor

    def spy(output, tensor, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
        inputs.append(tensor.data_ptr())
        return real(output, tensor, *args, **kwargs)

    dist.reduce_scatter_tensor = spy
    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 400, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    # Every gradient the reducer receives, accumulated or routed (the embedding's): [Note: routed grads]. Each is
    # kept alive until the step ends, so that no later staging buffer can reuse its address.
    alive: list[torch.Tensor] = []

    def seen(p, s, g):  # noqa: ANN001
        grad_ptrs[names[id(p)]] = g.data_ptr()
        alive.append(g)

    engine.zero3_manager.on_grad_ready(seen)
    engine.backward(engine(*micro_batch(0, dist.get_rank(), vocab=38)))
    engine.step()
    dist.reduce_scatter_tensor = real
    alive.clear()
    engine.destroy()
    return {"grads": grad_ptrs, "inputs": inputs}


def test_zero3_lone_large_gradient_is_reduced_without_a_staging_copy() -> None:
    """A parameter larger than the bucket (here the embedding and the head) is reduce-scattered from its own
    gradient; parameters that share a bucket still go through one staging buffer."""
    for r in run_distributed(_reduce_inputs, 2, 2):
        direct = {name for name, ptr in r["grads"].items() if ptr in r["inputs"]}
        assert {"embed.weight", "head.weight"} <= direct, (direct, r)
        assert "fc1.bias" not in direct
