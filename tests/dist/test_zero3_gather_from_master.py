"""ZeRO-3 gathering from the fp32 master (``lean_gather_from_master``, [Note: zero3-master]): a stepped,
partitioned parameter's shard is its slice of the master. Parity with the reference and bit-identity with the
switch off, the memory invariant (A/B), checkpoints across the two modes, ``GatheredParameters`` writes, the
``safe_*`` accessors and ``offload_states``."""

from __future__ import annotations

import os

import pytest
import torch

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch
from tests.reference.zero_oracle import engine_micro_index, reference_train

LR = 1e-2


def _config(master: bool, gas: int = 1, bf16: bool = False) -> dict:
    cfg: dict = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 500,
            "stage3_param_persistence_threshold": 30,  # the small biases stay gathered and keep their shard
            "lean_gather_from_master": master,
        },
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train(engine, steps: range, gas: int) -> None:  # noqa: ANN001
    from deepspeed import comm as dist

    world = dist.get_world_size()
    for step in steps:
        for m in range(gas):
            engine.backward(engine(*micro_batch(step, engine_micro_index(m, dist.get_rank(), world))))
            engine.step()


def _weights(engine) -> dict:  # noqa: ANN001
    """16-bit module weights (gathered) and the fp32 masters of the trainable parameters, every rank."""
    from deepspeed import comm as dist
    from deepspeed.utils import safe_get_full_fp32_param

    obj = [engine._zero3_consolidated_16bit_state_dict()]
    dist.broadcast_object_list(obj, src=0)
    masters = {}
    for name, p in engine.module.named_parameters():
        full = safe_get_full_fp32_param(p)
        if full is not None:
            masters[name] = full.clone()
    return {"module": obj[0], "masters": masters}


def _layout(engine) -> dict:  # noqa: ANN001
    """Per stepped state: (persistent, ds_tensor dtype, shard storage inside the group master's storage)."""
    facts = []
    for grp in engine.optimizer.groups:
        master_ptr = grp.master.data.untyped_storage().data_ptr()
        for state in grp.states:
            shard = state.param.ds_tensor
            facts.append((state.is_persistent, shard.dtype, shard.untyped_storage().data_ptr() == master_ptr))
    frozen = [
        (p.ds_tensor.dtype, p.ds_tensor.untyped_storage().nbytes() > 0)
        for p in engine.module.parameters()
        if not p.requires_grad
    ]
    return {"stepped": facts, "frozen": frozen}


def _run(master: bool, gas: int, bf16: bool, steps: int = 3) -> dict:
    import deepspeed

    model = make_model(0, tied=True, frozen_first=True)
    engine, *_ = deepspeed.initialize(model=model, config=_config(master, gas, bf16))
    layout = _layout(engine)
    _train(engine, range(steps), gas)
    out = {"layout": layout, "after": _layout(engine), **_weights(engine)}
    engine.destroy()
    return out


def _both(world: int, gas: int, bf16: bool) -> dict:
    return {"on": _run(True, gas, bf16), "off": _run(False, gas, bf16)}


def _reference(world: int, gas: int, dtype: torch.dtype) -> dict:
    model = make_model(0, tied=True, frozen_first=True)
    opt = lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.01)  # noqa: E731
    reference_train(model, 3, world, gas, opt, clip=1.0, working_dtype=dtype)
    return {k: v.detach().float() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gas", [1, 3])
@pytest.mark.parametrize("world", [1, 2])
def test_parity_bit_identity_and_memory_invariant(world: int, gas: int, bf16: bool) -> None:
    dtype = torch.bfloat16 if bf16 else torch.float32
    ref = _reference(world, gas, dtype)
    tol = 2e-2 if bf16 else 1e-5
    for r in run_distributed(_both, world, world, gas, bf16):
        on, off = r["on"], r["off"]
        for k, v in ref.items():
            rel = float((on["module"][k].float() - v).norm() / v.norm())
            assert rel < tol, f"{k}: {rel}"
            assert on["module"][k].dtype == dtype, k  # module weights stay in the working dtype
        # Gathering from the master gives exactly what the 16-bit copy held: both modes are bit-identical.
        for part in ("module", "masters"):
            for k in on[part]:
                assert torch.equal(on[part][k], off[part][k]), (part, k)
        for layout in (on["layout"], on["after"]):
            assert any(not p for p, _, _ in layout["stepped"])  # the test covers partitioned ones ...
            assert any(p for p, _, _ in layout["stepped"])  # ... and persistent ones
            for persistent, shard_dtype, inside in layout["stepped"]:
                # No partitioned stepped parameter owns a 16-bit shard: its ds_tensor lies in the master.
                assert inside is not persistent and (shard_dtype == torch.float32 or persistent), layout
                if persistent:
                    assert shard_dtype == dtype
            assert layout["frozen"] and all(d == dtype and alive for d, alive in layout["frozen"])
        for layout in (off["layout"], off["after"]):
            assert all(not inside and d == dtype for _, d, inside in layout["stepped"]), layout


def _save(master: bool, save_dir: str) -> None:
    import deepspeed

    engine, *_ = deepspeed.initialize(
        model=make_model(0, tied=True, frozen_first=True), config=_config(master, 1, True)
    )
    _train(engine, range(2), 1)
    engine.save_checkpoint(save_dir)
    engine.destroy()


def _resume(master: bool, save_dir: str, module_only: bool) -> dict:
    import deepspeed

    # The frozen fc1 is not in the optimizer's state (a load keeps the model's own values): same seed; the
    # trainable weights start elsewhere, so only the load can bring them back.
    model = make_model(0, tied=True, frozen_first=True)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.mul_(0.5).add_(0.1)
    engine, *_ = deepspeed.initialize(model=model, config=_config(master, 1, True))
    path, _ = engine.load_checkpoint(save_dir, load_module_only=module_only)
    assert path is not None
    loaded = _weights(engine)
    _train(engine, range(2, 4), 1)
    out = {"loaded": loaded, "final": _weights(engine), "layout": _layout(engine)}
    engine.destroy()
    return out


def _straight(master: bool) -> dict:
    import deepspeed

    engine, *_ = deepspeed.initialize(
        model=make_model(0, tied=True, frozen_first=True), config=_config(master, 1, True)
    )
    _train(engine, range(2), 1)
    at_save = _weights(engine)
    _train(engine, range(2, 4), 1)
    out = {"at_save": at_save, "final": _weights(engine)}
    engine.destroy()
    return out


@pytest.mark.parametrize("save_master,load_master", [(True, False), (False, True)])
def test_checkpoint_across_modes(tmp_path: object, save_master: bool, load_master: bool) -> None:
    save_dir = os.path.join(str(tmp_path), "ckpt")
    run_distributed(_save, 2, save_master, save_dir)
    model_file = os.path.join(save_dir, "global_step2", "zero_pp_rank_0_mp_rank_00_model_states.pt")
    saved = torch.load(model_file, map_location="cpu", weights_only=False)
    assert all(t.dtype == torch.bfloat16 for t in saved["module"].values() if t.is_floating_point())
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    consolidated = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    straight = run_distributed(_straight, 2, load_master)
    for k, v in straight[0]["at_save"]["masters"].items():
        assert torch.equal(consolidated[k].float(), v), k  # zero_to_fp32 rebuilds the masters exactly
    for r, s in zip(run_distributed(_resume, 2, load_master, save_dir, False), straight, strict=True):
        for part in ("module", "masters"):
            for k, v in s["at_save"][part].items():
                assert torch.equal(r["loaded"][part][k], v), ("loaded", part, k)
            for k, v in s["final"][part].items():
                assert torch.equal(r["final"][part][k], v), ("final", part, k)
        assert any(inside for _, _, inside in r["layout"]["stepped"]) is load_master


def test_module_only_load_rebuilds_the_master_from_the_16bit_weights(tmp_path: object) -> None:
    save_dir = os.path.join(str(tmp_path), "ckpt")
    run_distributed(_save, 2, False, save_dir)
    for r in run_distributed(_resume, 2, True, save_dir, True):
        for k, v in r["loaded"]["masters"].items():
            assert torch.equal(v, r["loaded"]["module"][k].float()), k  # the master is the loaded 16-bit weight


def _modify(world: int) -> dict:
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.utils import safe_get_full_fp32_param

    engine, *_ = deepspeed.initialize(model=make_model(0), config=_config(True, 1, True))
    _train(engine, range(1), 1)  # the masters now hold values a 16-bit copy cannot
    weight = engine.module.fc1.weight
    before = safe_get_full_fp32_param(weight).clone()
    with deepspeed.zero.GatheredParameters([weight], modifier_rank=0):
        if dist.get_rank() == 0:
            with torch.no_grad():
                weight[0].fill_(0.75)
    after = safe_get_full_fp32_param(weight).clone()
    with deepspeed.zero.GatheredParameters([weight]):
        gathered = weight.detach().float().clone()
    # A read-only context on one rank (the gathered tensor may alias the shard) leaves the master alone.
    with deepspeed.zero.GatheredParameters([weight]):
        with torch.no_grad():
            weight.zero_()
    untouched = safe_get_full_fp32_param(weight).clone()
    engine.destroy()
    return {"before": before, "after": after, "gathered": gathered, "untouched": untouched}


@pytest.mark.parametrize("world", [1, 2])
def test_gathered_parameters_modifier_writes_into_the_master(world: int) -> None:
    for r in run_distributed(_modify, world, world):
        before, after = r["before"], r["after"]
        assert torch.all(after[0] == 0.75)
        # Elements the modifier did not change keep their fp32 precision (not rounded to 16 bits).
        assert torch.equal(after[1:], before[1:])
        assert not torch.equal(before[1:], before[1:].bfloat16().float())
        assert torch.equal(r["gathered"], after.bfloat16().float())
        assert torch.equal(r["untouched"], after)


def _accessors_and_offload(world: int) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_local_fp32_param, safe_set_full_fp32_param

    engine, *_ = deepspeed.initialize(model=make_model(0), config=_config(True, 1, True))
    _train(engine, range(1), 1)
    weight = engine.module.fc2.weight
    new = torch.full(tuple(weight.ds_shape), 0.25)
    safe_set_full_fp32_param(weight, new)
    local = safe_get_local_fp32_param(weight)
    seen = {
        "set": torch.equal(safe_get_full_fp32_param(weight), new),
        "local_is_shard": torch.equal(local, weight.ds_tensor[: local.numel()]),
    }
    with deepspeed.zero.GatheredParameters([weight]):
        seen["gathered"] = torch.all(weight == 0.25).item()
    before = _weights(engine)
    engine.offload_states()
    shard = weight.ds_tensor
    master = engine.optimizer.groups[0].master.data
    seen["offloaded"] = (shard.device.type, shard.untyped_storage().data_ptr() == master.untyped_storage().data_ptr())
    engine.reload_states()
    shard = weight.ds_tensor
    master = engine.optimizer.groups[0].master.data
    seen["reloaded"] = shard.untyped_storage().data_ptr() == master.untyped_storage().data_ptr()
    after = _weights(engine)
    seen["same"] = all(torch.equal(before[p][k], after[p][k]) for p in before for k in before[p])
    # On a CPU-only host offload_states moves nothing; a master moved by hand must be followed the same way.
    for grp in engine.optimizer.groups:
        grp.master.param.data = grp.master.param.data.clone()
    engine.optimizer.rebind_master_views()
    _train(engine, range(1, 2), 1)
    seen["stepped"] = not torch.equal(safe_get_full_fp32_param(weight), new)
    with deepspeed.zero.GatheredParameters([weight]):
        seen["gathers_new_master"] = torch.equal(
            weight.detach().float(), safe_get_full_fp32_param(weight).bfloat16().float()
        )
    seen["still_views"] = _layout(engine)["stepped"]
    engine.destroy()
    return seen


def test_safe_accessors_and_offload_states_follow_the_master() -> None:
    for r in run_distributed(_accessors_and_offload, 2, 2):
        assert r["set"] and r["local_is_shard"] and r["gathered"], r
        assert r["offloaded"] == ("cpu", True) and r["reloaded"] and r["same"] and r["stepped"], r
        assert r["gathers_new_master"], r
        assert all(inside is not persistent for persistent, _, inside in r["still_views"])


def _offloaded_layout(kind: str) -> dict:
    import deepspeed

    cfg = _config(True, 1, True)
    cfg["zero_optimization"][kind] = {"device": "cpu"}
    engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
    _train(engine, range(1), 1)
    out = _layout(engine)
    engine.destroy()
    return out


@pytest.mark.parametrize("kind", ["offload_optimizer", "offload_param"])
def test_no_effect_with_offloading(kind: str) -> None:
    for r in run_distributed(_offloaded_layout, 2, kind):
        assert all(not inside and d == torch.bfloat16 for _, d, inside in r["stepped"]), r
