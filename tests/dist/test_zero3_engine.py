"""ZeRO-3 through the engine: zero.Init, awkward models, nothing gathered after training or eval,
destroy(), checkpoints (exact and elastic resume, zero_to_fp32), and saving that does not grow memory.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch
from tests.reference.zero_oracle import engine_micro_index, reference_train

GAS = 2


def _config(**zero: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 500,
            "stage3_param_persistence_threshold": 30,  # the small biases stay gathered
            **zero,
        },
    }


def _train(engine, steps: range, world: int) -> None:  # noqa: ANN001
    from deepspeed import comm as dist

    for step in steps:
        for m in range(GAS):
            engine.backward(engine(*micro_batch(step, engine_micro_index(m, dist.get_rank(), world))))
            engine.step()


def _full_weights(engine) -> dict:  # noqa: ANN001
    sd = engine._zero3_consolidated_16bit_state_dict()
    from deepspeed import comm as dist

    obj = [sd]
    dist.broadcast_object_list(obj, src=0)
    return {k: v.float() for k, v in obj[0].items()}


def _init_and_awkward(world: int) -> dict:
    import deepspeed

    cfg = _config()
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        model = make_model(0, tied=True, frozen_first=True)
    assert all(hasattr(p, "ds_id") for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    _train(engine, range(4), world)
    manager = engine.zero3_manager
    after_train = manager.count_gathered().units_alive
    engine.eval()
    with torch.no_grad():
        engine(*micro_batch(99, 0))
    after_eval = manager.count_gathered()
    weights = _full_weights(engine)
    engine.destroy()
    return dict(
        weights=weights,
        after_train=after_train,
        after_eval=after_eval.params_alive,
        persistent=sum(s.is_persistent for s in manager.states.values()),
    )


def test_zero_init_tied_frozen_and_nothing_left_gathered() -> None:
    world = 2
    results = run_distributed(_init_and_awkward, world, world)
    model = make_model(0, tied=True, frozen_first=True)
    reference_train(model, 4, world, GAS, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01), clip=1.0)
    for r in results:
        for k, v in model.state_dict().items():
            rel = float((r["weights"][k] - v).norm() / v.norm())
            assert rel < 1e-5, f"{k}: {rel}"
        # Only persistent (small) parameters may stay gathered after training or an eval forward.
        assert r["after_eval"] <= r["persistent"], r


def _save(world: int, save_dir: str, steps: int) -> None:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(0), config=_config())
    _train(engine, range(steps), world)
    from deepspeed.accelerator import get_accelerator

    gathered = []
    for i in range(10):  # repeated saves leave nothing gathered behind
        engine.save_checkpoint(save_dir, tag=f"extra{i}")
        gathered.append(engine.zero3_manager.count_gathered().params_alive)
    engine.save_checkpoint(save_dir)
    assert len(set(gathered)) == 1, gathered
    del get_accelerator


def _resume(world: int, save_dir: str, start: int, end: int) -> dict:
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(7), config=_config())
    path, _ = engine.load_checkpoint(save_dir)
    assert path is not None and engine.global_steps == start
    _train(engine, range(start, end), world)
    return _full_weights(engine)


def _reference(worlds: list[int]) -> dict:
    """fp32 single-process training where step ``s`` sees ``worlds[s] * GAS`` micro-batches."""
    model = make_model(0)
    opt = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01)  # noqa: E731
    reference_train(model, len(worlds), worlds, GAS, opt, clip=1.0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("save_world,load_world", [(2, 2), (2, 1), (2, 4), (4, 2)])
def test_zero3_resume(tmp_path: object, save_world: int, load_world: int) -> None:
    save_dir = os.path.join(str(tmp_path), "ckpt")
    run_distributed(_save, save_world, save_world, save_dir, 3)
    files = sorted(os.listdir(os.path.join(save_dir, "global_step3")))
    assert files == sorted(
        [f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in range(save_world) for kind in ("model", "optim")]
    )
    # zero_to_fp32 reconstructs the trained fp32 weights from our files.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    consolidated = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    at_save = _reference([save_world] * 3)
    for k, v in at_save.items():
        assert float((consolidated[k].float() - v).norm() / v.norm()) < 1e-5, k
    results = run_distributed(_resume, load_world, load_world, save_dir, 3, 5)
    ref = _reference([save_world] * 3 + [load_world] * 2)
    for r in results:
        for k, v in ref.items():
            rel = float((r[k] - v).norm() / v.norm())
            assert rel < 1e-5, f"{k}: {rel}"


def _safe_get_z3(world: int) -> dict:
    import deepspeed
    from deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_set_full_fp32_param,
    )

    engine, *_ = deepspeed.initialize(model=make_model(0), config=_config())
    _train(engine, range(2), world)
    full = _full_weights(engine)
    out = {}
    for name, p in engine.module.named_parameters():
        got = safe_get_full_fp32_param(p)
        out[name] = bool(torch.equal(got, full[name]))
        exp_avg = safe_get_full_optimizer_state(p, "exp_avg")
        out[name + ".exp_avg_shape"] = tuple(exp_avg.shape) == tuple(full[name].shape)
        out[name + ".local"] = safe_get_local_fp32_param(p).numel() <= -(-p.ds_numel // world)
    assert safe_get_full_grad(engine.module.fc2.weight) is None  # gradients exist only inside a window
    target = torch.full_like(full["fc2.weight"], 0.5)
    safe_set_full_fp32_param(engine.module.fc2.weight, target)
    out["set"] = bool(torch.equal(safe_get_full_fp32_param(engine.module.fc2.weight), target))
    engine.destroy()
    return out


def test_safe_get_helpers_under_zero3() -> None:
    for r in run_distributed(_safe_get_z3, 2, 2):
        assert all(r.values()), {k: v for k, v in r.items() if not v}


def _offload_placement(world: int) -> dict:
    import deepspeed

    cfg = _config(offload_optimizer={"device": "cpu", "pin_memory": True})
    cfg["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
    opt = engine.optimizer
    seen = {}
    for m in range(GAS):  # stop before the boundary step to look at the accumulated shards
        engine.backward(engine(*micro_batch(0, engine_micro_index(m, 0, world))))
        if m < GAS - 1:
            engine.step()
    seen["acc"] = [(g.accumulator.dtype, g.accumulator.device.type) for g in opt.groups]
    seen["master"] = [(g.master.dtype, g.master.device.type, g.master.param.is_pinned()) for g in opt.groups]
    engine.step()
    seen["after_step"] = opt.live_grad_buffers()
    seen["state_devices"] = {
        v.device.type for st in opt.optimizer.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0
    }
    engine.destroy()
    return seen


def test_zero3_offload_keeps_host_state_lean() -> None:
    """Offloaded ZeRO-3: masters and moments pageable on the host, gradient shards in grad_accum_dtype."""
    (seen,) = run_distributed(_offload_placement, 1, 1)
    assert seen["acc"] and all(a == (torch.bfloat16, "cpu") for a in seen["acc"])  # bf16 run: bg = 2 bytes
    assert all(m == (torch.float32, "cpu", False) for m in seen["master"])
    assert seen["state_devices"] == {"cpu"}
    assert seen["after_step"]["accumulators"] == 0 and seen["after_step"]["param_grads"] == 0


def _write_back_order(world: int) -> dict:
    import deepspeed
    from deepspeed._core.optim.master import MasterShard, ScatterWriteBack

    seen: dict = {}
    for offload, overlap in ((False, False), (True, False), (True, True)):
        zero: dict = {"lean_overlap_offload_step": overlap}
        if offload:
            zero.update(offload_param={"device": "cpu"}, offload_optimizer={"device": "cpu"})
        engine, *_ = deepspeed.initialize(model=make_model(0), config=_config(**zero))
        gatherer = engine.optimizer.manager.gatherer
        log: list[str] = []
        sync, write, publish = gatherer.sync_shard_reads, MasterShard.write_back, ScatterWriteBack.publish

        def spy_sync(sync=sync, log=log) -> None:  # noqa: ANN001
            log.append("sync")
            sync()

        def spy_write(self, write=write, log=log) -> None:  # noqa: ANN001
            log.append("write")
            write(self)

        def spy_publish(self, start, piece, publish=publish, log=log) -> None:  # noqa: ANN001
            log.append("write")
            publish(self, start, piece)

        gatherer.sync_shard_reads = spy_sync
        MasterShard.write_back = spy_write
        ScatterWriteBack.publish = spy_publish
        try:
            _train(engine, range(1), world)
        finally:
            MasterShard.write_back = write
            ScatterWriteBack.publish = publish
        seen[(offload, overlap)] = log
        engine.destroy()
    return seen


def test_offloaded_shards_are_written_back_only_after_the_copy_ins_read_them() -> None:
    """With offload_param the step's host writes into the shards wait for the last copy-in first, whether the
    host step is synchronous or overlapped (chunks published as they are stepped); without it the write-back is
    stream-ordered and the host does not wait."""
    (seen,) = run_distributed(_write_back_order, 1, 1)
    for overlap in (False, True):
        log = seen[(True, overlap)]
        assert log and log[0] == "sync" and "write" in log, (overlap, log)
    assert seen[(False, False)] and "sync" not in seen[(False, False)]
