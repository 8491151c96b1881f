"""ZenFlow at ZeRO-1/2 with the optimizer offloaded ([Note: zenflow]): with every column selected, or with a host
update every step and no overlap, it is the plain offloaded step; with ``overlap_step`` the host update of step t
lands at step t + 1, as a small single-process reference computes; bad values error naming the key."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch
from tests.reference.zero_oracle import engine_micro_index

STEPS = 5
LR, WD, BETAS, EPS = 1e-2, 0.01, (0.9, 0.999), 1e-8


def _config(stage: int, zenflow: dict | None) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": 400, "offload_optimizer": {"device": "cpu"}}
    if zenflow is not None:
        zero["zenflow"] = zenflow
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "betas": list(BETAS), "eps": EPS}},
        "zero_optimization": zero,
    }


def _published(engine) -> dict:
    """Whether this rank's slice of every working flat buffer holds its master rounded to the working dtype (what
    publishing the selected columns alone must leave, as publishing everything does), and how many steps
    published the selected columns alone."""
    opt = engine.optimizer
    if opt.zenflow is not None:
        opt.zenflow.sync_columns()  # the masters of the columns stepped on the device, home first
    zen = opt.zenflow
    # An in-place host update in flight is in the masters already and reaches the working weights at the next
    # step ([Note: zenflow in-place host update]): only the other elements compare then.
    in_flight = zen is not None and zen.pending is not None and zen.pending.in_place
    exact, segmented = True, False
    for index, group in enumerate(opt.groups):
        writer = group.master.writer
        pieces = writer.flat.pieces(writer.partition)  # one per segment of the flat buffer it spans
        mine, expected = torch.cat(pieces), group.master.param.detach()
        if in_flight:
            keep = zen.groups[index].split.mask(selected=True)
            mine, expected = mine[keep], expected[keep]
        exact = exact and torch.equal(mine, expected.to(mine.dtype))
        segmented = segmented or len(pieces) > 1
    if zen is None:
        return {"exact": exact, "partial": 0, "on_device": False, "segmented": segmented}
    return {"exact": exact, "partial": zen.partial_publishes, "on_device": zen.column_steps > 0, "segmented": segmented}


def _train(world: int, stage: int, zenflow: dict | None, segment_numel: int | None = None) -> dict:
    import deepspeed
    from deepspeed import comm as dist

    config = _config(stage, zenflow)
    if segment_numel is not None:  # the flat buffers are built in segments of about this many elements
        config["zero_optimization"]["allgather_bucket_size"] = segment_numel
    engine, *_ = deepspeed.initialize(model=make_model(0), config=config)
    for step in range(STEPS):
        engine.backward(engine(*micro_batch(step, engine_micro_index(0, dist.get_rank(), world))))
        engine.step()
    zen = engine.optimizer.zenflow
    out = {
        "weights": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
        "host_updates": zen.host_updates if zen is not None else 0,
        "published": _published(engine),
    }
    engine.destroy()
    return out


_SPLIT = {"topk_ratio": 0.3, "select_strategy": "step", "select_interval": 100}


def _runs(world: int, stage: int) -> dict:
    return {
        "plain": _train(world, stage, None),
        "all_selected": _train(world, stage, {"topk_ratio": 0.99, "update_interval": 2, "overlap_step": True}),
        "every_step": _train(world, stage, {**_SPLIT, "update_interval": 1, "overlap_step": False}),
        "delayed": _train(world, stage, {**_SPLIT, "update_interval": 2, "overlap_step": True}),
        "delayed_segmented": _train(world, stage, {**_SPLIT, "update_interval": 2, "overlap_step": True}, 40),
    }


def _adamw(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int) -> None:
    p.mul_(1 - LR * WD)
    m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
    v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
    denom = v.sqrt().div_(math.sqrt(1 - BETAS[1] ** t)).add_(EPS)
    p.addcdiv_(m, denom, value=-LR / (1 - BETAS[0] ** t))


def _reference(update_interval: int, delayed: bool) -> dict:
    """ZenFlow on one process in plain PyTorch: columns chosen once from the first gradient, the selected elements
    stepped every step, the others' mean gradient every ``update_interval`` steps, applied at the next step's
    boundary (after its backward) when ``delayed``."""
    model = make_model(0)
    params = dict(model.named_parameters())
    m = {k: torch.zeros_like(p) for k, p in params.items()}
    v = {k: torch.zeros_like(p) for k, p in params.items()}
    acc = {k: torch.zeros_like(p) for k, p in params.items()}
    masks: dict[str, torch.Tensor] = {}
    t_sel = t_host = count = 0
    pending: dict | None = None
    for step in range(STEPS):
        model.zero_grad()
        model(*micro_batch(step, 0)).backward()
        grads = {k: p.grad.detach().clone() for k, p in params.items()}
        if pending is not None:  # the previous step's host update lands at this step's boundary
            for k, (pv, mv, vv) in pending.items():
                rest = ~masks[k]
                params[k].data[rest], m[k][rest], v[k][rest] = pv, mv, vv
            pending = None
        if not masks:
            for k, g in grads.items():
                keep = torch.ones_like(g, dtype=torch.bool)
                if g.dim() == 2:
                    norms = g.norm(dim=0)
                    cols = torch.zeros_like(norms, dtype=torch.bool)
                    cols[torch.topk(norms, math.ceil(_SPLIT["topk_ratio"] * g.shape[1])).indices] = True
                    keep = cols.expand_as(g).clone()
                masks[k] = keep
        t_sel += 1
        for k, p in params.items():
            sel = masks[k]
            pv, mv, vv = p.data[sel].clone(), m[k][sel].clone(), v[k][sel].clone()
            _adamw(pv, grads[k][sel], mv, vv, t_sel)
            p.data[sel], m[k][sel], v[k][sel] = pv, mv, vv
            acc[k][~sel] += grads[k][~sel]
        count += 1
        if count == update_interval:
            t_host += 1
            update = {}
            for k, p in params.items():
                rest = ~masks[k]
                pv, mv, vv = p.data[rest].clone(), m[k][rest].clone(), v[k][rest].clone()
                _adamw(pv, acc[k][rest] / count, mv, vv, t_host)
                update[k] = (pv, mv, vv)
                acc[k].zero_()
            count = 0
            if delayed:
                pending = update
            else:
                for k, (pv, mv, vv) in update.items():
                    rest = ~masks[k]
                    params[k].data[rest], m[k][rest], v[k][rest] = pv, mv, vv
    return {k: p.detach().clone() for k, p in model.state_dict().items()}


def _close(a: dict, b: dict) -> bool:
    return all(torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6) for k in b)


@pytest.mark.parametrize(("world", "stage"), [(1, 2), (2, 1)])
def test_zenflow_reduces_to_the_plain_step_and_delays_by_one_step(world: int, stage: int) -> None:
    for rank in run_distributed(_runs, world, world, stage):
        plain = rank["plain"]["weights"]
        # Every column selected (and every 1-D parameter always): nothing is left for the host path.
        assert rank["all_selected"]["host_updates"] == 0
        for k in plain:
            assert torch.equal(rank["all_selected"]["weights"][k], plain[k]), k
        # A host update every step, not overlapped: the same update, split in two packed steps. The selected
        # elements are stepped beside the working weights by the same rule in torch operations, which may round
        # differently from the host kernel ([Note: zenflow columns]): equal to within an ulp or so.
        assert rank["every_step"]["host_updates"] == STEPS
        for k in plain:
            assert torch.allclose(rank["every_step"]["weights"][k], plain[k], rtol=1e-6, atol=1e-7), k
        # Between host updates only the selected columns go up, and the weights are the masters' all the same.
        partial = {"exact": True, "partial": STEPS // 2, "on_device": True}
        assert rank["delayed"]["published"] == {**partial, "segmented": False}
        # The same when the partition spans several segments of the flat buffer, with the same weights.
        assert rank["delayed_segmented"]["published"] == {**partial, "segmented": True}
        for k in plain:
            assert torch.equal(rank["delayed_segmented"]["weights"][k], rank["delayed"]["weights"][k]), k
        assert not rank["all_selected"]["published"]["on_device"]  # nothing left for a late path: the host steps
        assert all(rank[run]["published"]["exact"] for run in ("all_selected", "every_step"))
        if world == 1:
            delayed = rank["delayed"]
            assert delayed["host_updates"] == STEPS // 2  # applied at steps 2 and 4
            weights = delayed["weights"]
            assert _close(weights, _reference(2, delayed=True))
            # Applying the host update at once instead gives other weights: the delay is visible.
            assert not _close(weights, _reference(2, delayed=False))
            assert not _close(weights, plain)


def _gathered_or_sent(world: int, stage: int, gather: bool, rewrite: bool) -> dict:
    """Train with the selected columns' gradient gathered on the device as it lands (``gather``), or packed on
    the host and sent; ``rewrite``: double one weight's gradient through ``safe_set_full_grad`` before one step."""
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

    config = _config(stage, {**_SPLIT, "update_interval": 3, "overlap_step": True})
    config["gradient_accumulation_steps"] = 2
    config["gradient_clipping"] = 0.5  # a coefficient other than one on most steps
    engine, *_ = deepspeed.initialize(model=make_model(0), config=config)
    if not gather:
        engine.optimizer.grad_pipeline.sunk = None
    weight = next(p for p in engine.module.parameters() if p.dim() == 2)
    for step in range(5):
        for micro in range(2):
            engine.backward(engine(*micro_batch(step, engine_micro_index(micro, dist.get_rank(), world))))
            if rewrite and step == 3 and micro == 1:
                safe_set_full_grad(weight, 2 * safe_get_full_grad(weight))
            engine.step()
    out = {
        "weights": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
        "gathered": engine.optimizer.zenflow.gathered_steps,
        "on_device": engine.optimizer.zenflow.column_steps,
        "selections": engine.optimizer.zenflow.selections,
    }
    engine.destroy()
    return out


@pytest.mark.parametrize(("world", "stage"), [(1, 2), (2, 1), (2, 2)])
def test_the_columns_gradient_gathered_on_the_device_is_the_one_the_host_sends(world: int, stage: int) -> None:
    # [Note: zenflow columns]: gathered from each delivered piece (added over the window's micro-steps at stage 2,
    # copied once at stage 1), the selected gradient steps the columns to the same bits as the one packed on the
    # host and sent; a gradient written on the host in between voids the gathered one for that step.
    for rewrite in (False, True):
        gathered = run_distributed(_gathered_or_sent, world, world, stage, True, rewrite)
        sent = run_distributed(_gathered_or_sent, world, world, stage, False, rewrite)
        for a, b in zip(gathered, sent, strict=True):
            assert a["on_device"] == b["on_device"] > 0 and b["gathered"] == 0
            # The step of a selection steps the new columns on a gradient gathered under none: it is sent.
            assert a["gathered"] == a["on_device"] - a["selections"] - rewrite, (a["gathered"], a["on_device"])
            for k, v in b["weights"].items():
                assert torch.equal(a["weights"][k], v), (rewrite, k)


def _safe_helpers_see_the_device_columns(world: int) -> dict:
    """Train with the every-step path on the device, then read and write masters through the safe_* helpers."""
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    engine, *_ = deepspeed.initialize(
        model=make_model(0), config=_config(2, {**_SPLIT, "update_interval": 3, "overlap_step": True})
    )

    def train(steps: range) -> None:
        for step in steps:
            engine.backward(engine(*micro_batch(step, engine_micro_index(0, dist.get_rank(), world))))
            engine.step()

    # Columns chosen at step 0; step 1 publishes them alone (their host masters go stale), and so would step 2:
    # the first host update is submitted at step 2 and lands at step 3 (in the masters at once: it steps them in
    # place, [Note: zenflow in-place host update]).
    train(range(2))
    named = dict(engine.module.named_parameters())
    read = {n: safe_get_full_fp32_param(p) for n, p in named.items()}
    out = {
        "column_steps": engine.optimizer.zenflow.column_steps,
        "partial": engine.optimizer.zenflow.partial_publishes,
        "read_is_weight": all(torch.equal(read[n], p.detach()) for n, p in named.items()),
    }
    name = next(n for n, p in named.items() if p.dim() == 2)
    safe_set_full_fp32_param(named[name], torch.zeros_like(read[name]))
    out["set_kept"] = torch.equal(safe_get_full_fp32_param(named[name]), torch.zeros_like(read[name]))
    # The step after the write sends the whole master up, the written value with it; the next one the host update.
    train(range(2, 4))
    again = {n: safe_get_full_fp32_param(p) for n, p in named.items()}
    out["weights_are_masters"] = all(torch.equal(again[n], p.detach()) for n, p in named.items())
    engine.destroy()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_safe_helpers_read_and_write_through_the_device_columns(world: int) -> None:
    for rank in run_distributed(_safe_helpers_see_the_device_columns, world, world):
        assert rank["column_steps"] > 0 and rank["partial"] > 0
        assert rank["read_is_weight"]  # the columns were written back before the read
        assert rank["set_kept"]  # ... and forgotten before the write, so it is not overwritten
        assert rank["weights_are_masters"]  # the step after a write publishes everything


def _offload_states_mid_run(world: int, park: bool) -> dict:
    import deepspeed
    from deepspeed import comm as dist

    engine, *_ = deepspeed.initialize(
        model=make_model(0), config=_config(2, {**_SPLIT, "update_interval": 3, "overlap_step": True})
    )
    held = []
    for step in range(5):
        engine.backward(engine(*micro_batch(step, engine_micro_index(0, dist.get_rank(), world))))
        engine.step()
        if park and step == 1:
            engine.offload_states()
            held.append(len(engine.optimizer.zenflow.columns))
            engine.reload_states()
    out = {"held": held, "weights": {k: v.detach().clone() for k, v in engine.module.state_dict().items()}}
    engine.destroy()
    return out


def test_offload_states_brings_the_device_columns_home_and_training_continues_the_same() -> None:
    plain = run_distributed(_offload_states_mid_run, 1, 1, False)[0]
    parked = run_distributed(_offload_states_mid_run, 1, 1, True)[0]
    assert parked["held"] == [0]  # no columns left on the device while the states are parked
    for k, v in plain["weights"].items():
        assert torch.equal(parked["weights"][k], v), k


def _accumulation_order(world: int) -> list[str]:
    import time

    import deepspeed
    from deepspeed import comm as dist

    engine, *_ = deepspeed.initialize(model=make_model(0), config=_config(2, {**_SPLIT, "update_interval": 3}))
    zen = engine.optimizer.zenflow
    events: list[str] = []
    add = zen._add_to_accumulators

    def slow_add(*args):  # a slow host: the addition is still running when the next backward begins
        time.sleep(0.3)
        add(*args)
        events.append("accumulated")

    zen._add_to_accumulators = slow_add
    for step in range(3):
        loss = engine(*micro_batch(step, engine_micro_index(0, dist.get_rank(), world)))
        loss.register_hook(lambda grad: events.append("backward") or grad)
        engine.backward(loss)
        engine.step()
    zen.finish_accumulating()
    engine.destroy()
    return events


def test_the_next_backward_waits_for_the_deferred_accumulation() -> None:
    # The last step's partition gradients are read by the worker until their sums are in the accumulators; the
    # next backward overwrites them, so it must start only after ([Note: zenflow deferred accumulation]).
    events = run_distributed(_accumulation_order, 1, 1)[0]
    assert events.count("accumulated") == 3, events
    for i, event in enumerate(events):
        if event == "backward" and i > 0:
            assert events[i - 1] == "accumulated", events


def _refresh_in_flight(world: int) -> dict:
    import deepspeed
    from deepspeed import comm as dist

    engine, *_ = deepspeed.initialize(model=make_model(0), config=_config(2, _RESUME))
    _train_steps(engine, range(4), world)  # the second host update (in place) is in flight after step 4
    zen, opt = engine.optimizer.zenflow, engine.optimizer
    in_flight = zen.pending is not None and zen.pending.in_place
    opt.refresh_fp32_params()  # applies it first, then rebuilds the masters from the working weights
    out = {
        "in_flight": in_flight,
        "applied": (zen.pending is None, zen.host_updates, zen.in_place_updates),
        "masters_are_working": all(
            torch.equal(g.master.param.detach(), torch.cat(g.master.writer.flat.pieces(g.master.writer.partition)))
            for g in opt.groups
        ),
    }
    loss = engine(*micro_batch(4, engine_micro_index(0, dist.get_rank(), world)))
    engine.backward(loss)
    engine.step()
    out["trains_on"] = math.isfinite(float(loss))
    engine.destroy()
    return out


def test_refresh_fp32_params_applies_a_host_update_in_flight_first() -> None:
    for rank in run_distributed(_refresh_in_flight, 2, 2):
        assert rank == {"in_flight": True, "applied": (True, 2, 2), "masters_are_working": True, "trains_on": True}


def _config_error(zenflow: dict, **top: object) -> str:
    from deepspeed.runtime.config import DeepSpeedConfig

    with pytest.raises(Exception) as info:
        DeepSpeedConfig({**_config(2, zenflow), **top})
    assert type(info.value).__name__ == "DeepSpeedConfigError"
    return str(info.value)


@pytest.mark.parametrize(
    ("zenflow", "top", "named"),
    [
        ({"topk_ratio": 1.0}, {}, "zenflow.topk_ratio"),
        ({"topk_ratio": 0.0}, {}, "zenflow.topk_ratio"),
        ({"select_strategy": "often"}, {}, "select_strategy"),
        ({"update_interval": 0}, {}, "update_interval"),
        ({"select_strategy": "step", "select_interval": 2, "update_interval": 4}, {}, "select_interval"),
        ({"select_interval": 3}, {}, "select_interval"),
        ({}, {"gradient_allreduce_op": "sum"}, "gradient_allreduce_op"),
    ],
)
def test_bad_zenflow_values_name_the_key(zenflow: dict, top: dict, named: str) -> None:
    assert named in _config_error(zenflow, **top)


def test_zenflow_at_stage_3_and_super_offload_are_refused_naming_zenflow() -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = _config(3, {})
    with pytest.raises(Exception, match="zenflow.*stage"):
        DeepSpeedConfig(cfg)
    cfg = _config(2, None)
    cfg["zero_optimization"]["offload_optimizer"]["super_offload"] = True
    with pytest.raises(Exception, match="zero_optimization.zenflow"):
        DeepSpeedConfig(cfg)
    cfg = _config(2, {})
    del cfg["zero_optimization"]["offload_optimizer"]
    with pytest.raises(Exception, match="zenflow needs offload_optimizer.device"):
        DeepSpeedConfig(cfg)


def _train_bf16_auto(world: int) -> dict:
    import deepspeed
    from deepspeed import comm as dist

    cfg = _config(2, {"topk_ratio": 0.2, "update_interval": "auto", "overlap_step": True})
    cfg.update({"bf16": {"enabled": True}, "gradient_accumulation_steps": 2})
    engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
    losses = []
    for step in range(6):
        for micro in range(2):
            loss = engine(*micro_batch(step, engine_micro_index(micro, dist.get_rank(), world)))
            engine.backward(loss)
            engine.step()
        losses.append(float(loss))
    zen = engine.optimizer.zenflow
    out = {
        "losses": losses,
        "host_updates": zen.host_updates,
        "weights": {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()},
        "published": _published(engine),
    }
    engine.destroy()
    return out


def test_zenflow_bf16_with_accumulation_and_auto_interval_on_two_ranks() -> None:
    ranks = run_distributed(_train_bf16_auto, 2, 2)
    for rank in ranks:
        assert all(math.isfinite(x) for x in rank["losses"])
        assert rank["host_updates"] > 0  # the auto rule fired at least once
        assert rank["published"]["exact"] and rank["published"]["partial"] > 0  # bf16 columns sent alone
    for k in ranks[0]["weights"]:  # every rank holds the same gathered weights
        assert torch.equal(ranks[0]["weights"][k], ranks[1]["weights"][k]), k


# --- checkpoints: exact resume ([Note: zenflow checkpoint]) -----------------------------------------------------
# Columns selected again every 2 steps, a host update every 2 steps applied one step late: after 2 steps a host
# update is in flight (the accumulator is empty), after 3 steps the accumulator holds one step and nothing is in
# flight. A run of 6 steps ends with an update in flight again.
_RESUME = {**_SPLIT, "select_interval": 2, "update_interval": 2, "overlap_step": True}
RESUME_STEPS = 6
TAGS = {"in_flight": 2, "mid_interval": 3, "in_flight_later": 4}


def _zen_engine(zenflow: dict | None = _RESUME, gas: int = 1, universal: bool = False, bf16: bool = False):
    import deepspeed

    cfg = _config(2, zenflow)
    cfg["gradient_accumulation_steps"] = gas
    if bf16:  # the working weights in bf16: a checkpoint's working partition is saved in bf16
        cfg["bf16"] = {"enabled": True}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=make_model(7), config=cfg)  # the checkpoint overwrites this init
    return engine


def _train_steps(engine, steps: range, world: int) -> None:
    from deepspeed import comm as dist

    gas = engine.gradient_accumulation_steps()
    for step in steps:
        for micro in range(gas):
            engine.backward(engine(*micro_batch(step, engine_micro_index(micro, dist.get_rank(), world))))
            engine.step()


def _zen_state(engine) -> dict:
    """What this rank's shard holds for ZenFlow (padding removed), as saved."""
    from deepspeed._core.optim.stage12_state import _zenflow_shard

    return _zenflow_shard(engine.optimizer)


def _snapshot(engine) -> dict:
    opt = engine.optimizer
    zen = _zen_state(engine)  # first: it waits for a host update in flight, which may be writing the masters
    return {
        "weights": {k: v.detach().clone() for k, v in engine.module.state_dict().items()},
        "masters": [g.master.param.detach().clone() for g in opt.groups],
        "moments": [{k: v.clone() for k, v in s.items() if torch.is_tensor(v)} for s in opt.optimizer.state.values()],
        "zenflow": zen,
    }


def _use_route(route: str) -> None:
    """``"packed"``: this process's host updates take the packed route, the one an every-step path on the host
    takes, instead of stepping in place ([Note: zenflow in-place host update])."""
    if route == "packed":
        from deepspeed._core.optim.zenflow import ZenFlowUpdate

        ZenFlowUpdate._in_place_ok = lambda self: False  # type: ignore[method-assign]


def _resume_runs(world: int, folder: str, route: str = "in_place") -> dict:
    """An uninterrupted run saving at ``TAGS``, then a fresh engine resumed from each tag to the same end
    (``route`` ``"bf16"``: in place, with bf16 working weights)."""
    _use_route(route)
    bf16 = route == "bf16"
    engine = _zen_engine(bf16=bf16)
    saved = {}
    for step in range(RESUME_STEPS):
        _train_steps(engine, range(step, step + 1), world)
        for tag, done in TAGS.items():
            if step + 1 == done:
                engine.save_checkpoint(folder, tag=tag)
                saved[tag] = _zen_state(engine)
    zen = engine.optimizer.zenflow
    out: dict = {"saved": saved, "final": _snapshot(engine), "resumed": {}, "loaded": {}}
    out["updates"] = {"all": zen.host_updates, "in_place": zen.in_place_updates}
    engine.destroy()
    for tag, done in TAGS.items():
        engine = _zen_engine(bf16=bf16)
        engine.load_checkpoint(folder, tag=tag)
        assert engine.global_steps == done
        out["loaded"][tag] = _zen_state(engine)
        _train_steps(engine, range(done, RESUME_STEPS), world)
        out["resumed"][tag] = _snapshot(engine)
        engine.destroy()
    return out


def _same(a: object, b: object, where: str = "") -> None:
    """Bit-for-bit equality of nested dicts / lists / tensors / scalars."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a.keys(), getattr(b, "keys", list)())
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory):
    """``get(world, route)``: the checkpoint folder and per-rank results of :func:`_resume_runs` (run once each)."""
    cache: dict = {}

    def get(world: int, route: str = "in_place") -> tuple:
        if (world, route) not in cache:
            folder = tmp_path_factory.mktemp(f"zenflow_w{world}_{route}")
            cache[world, route] = (str(folder), run_distributed(_resume_runs, world, world, str(folder), route))
        return cache[world, route]

    return get


@pytest.mark.parametrize(
    ("world", "route"), [(1, "in_place"), (2, "in_place"), (1, "packed"), (2, "packed"), (1, "bf16")]
)
def test_zenflow_resume_is_bit_exact_mid_interval_and_with_an_update_in_flight(
    resume_runs, world: int, route: str
) -> None:
    _, ranks = resume_runs(world, route)
    for rank in ranks:
        # Host updates after steps 2 and 4 applied (one in flight at the end), in place unless the route is packed.
        assert rank["updates"] == {"all": 2, "in_place": 0 if route == "packed" else 2}
        saved = rank["saved"]
        # An update in flight is saved as the values it writes (packed) or as the working partitions it has not
        # reached (in place); either way the resumed run applies it at its next step.
        in_place = route != "packed"
        for tag in ("in_flight", "in_flight_later"):  # the late path's first host update, and its second
            in_flight = saved[tag]["partitions"]
            assert ("pending_working" in in_flight) == in_place and ("pending_values" in in_flight) != in_place
        if route == "bf16":  # the working partition is saved as the working weights hold it
            assert all(t.dtype == torch.bfloat16 for t in saved["in_flight_later"]["partitions"]["pending_working"])
        # What the two checkpoints hold: an update in flight (not yet applied), then a non-empty accumulator.
        assert saved["in_flight"]["pending_host_step_counts"] is not None
        assert not saved["in_flight"]["partitions"]["accumulator"][0].any()
        assert saved["mid_interval"]["pending_host_step_counts"] is None
        assert saved["mid_interval"]["accumulated"] == 1
        assert all(a.any() for a in saved["mid_interval"]["partitions"]["accumulator"])
        assert rank["final"]["zenflow"]["pending_host_step_counts"] is not None
        for tag in TAGS:
            _same(rank["loaded"][tag], saved[tag], f"{tag} loaded")  # restored exactly as saved ...
            _same(rank["resumed"][tag], rank["final"], tag)  # ... and continued exactly as uninterrupted


def _elastic_resume(folder: str) -> dict:
    """Load the 2-rank checkpoints on one rank (2 micro-batches per step: the same samples) and continue."""
    out: dict = {"loaded": {}, "final": {}}
    for tag, done in TAGS.items():
        engine = _zen_engine(gas=2)
        engine.load_checkpoint(folder, tag=tag)
        out["loaded"][tag] = _zen_state(engine)
        _train_steps(engine, range(done, RESUME_STEPS), 1)
        out["final"][tag] = _snapshot(engine)["weights"]
        engine.destroy()
    return out


def _joined(pieces: list[dict]) -> dict:
    """One-rank view of several ranks' saved ZenFlow state: partition tensors concatenated in rank order."""
    parts = {
        k: [torch.cat(ts) for ts in zip(*(p["partitions"][k] for p in pieces), strict=True)]
        for k in pieces[0]["partitions"]
    }
    return {**pieces[0], "partitions": parts}


def test_zenflow_state_saved_on_two_ranks_loads_on_one_exactly(resume_runs) -> None:
    folder, ranks = resume_runs(2)
    out = run_distributed(_elastic_resume, 1, folder)[0]
    for tag in TAGS:
        # The accumulator and the update in flight are re-sliced like the master: the same values, one partition.
        _same(out["loaded"][tag], _joined([r["saved"][tag] for r in ranks]), tag)
        # Training on continues as on two ranks (the same samples; only the order of the gradient sums differs).
        assert _close(out["final"][tag], ranks[0]["final"]["weights"]), tag


def _load_without_state(folder: str, zenflow_off_folder: str) -> dict:
    """Load checkpoints holding no ZenFlow state into a ZenFlow run, and a ZenFlow checkpoint into a plain run."""
    import logging

    from deepspeed.utils.logging import logger

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        plain = _zen_engine(None)  # a run with ZenFlow off writes the checkpoint
        _train_steps(plain, range(2), 1)
        plain.save_checkpoint(zenflow_off_folder, tag="off")
        plain.destroy()
        engine = _zen_engine()
        engine.load_checkpoint(zenflow_off_folder, tag="off")
        zen = engine.optimizer.zenflow
        fresh = {"accumulator": [g.acc for g in zen.groups], "steps": [dict(s.selected) for s in zen.scalars]}
        _train_steps(engine, range(2, 4), 1)
        engine.destroy()
        said_fresh = [r.getMessage() for r in records if "zenflow" in r.getMessage()]
        records.clear()
        plain = _zen_engine(None)  # the other way round: ZenFlow's keys are ignored, saying so
        plain.load_checkpoint(folder, tag="mid_interval")
        plain.destroy()
        said_ignored = [r.getMessage() for r in records if "zenflow" in r.getMessage().lower()]
        # A universal checkpoint (per-parameter files) has no per-rank ZenFlow state either.
        from deepspeed.checkpoint.ds_to_universal import main, parse_arguments

        universal = os.path.join(folder, "universal")
        main(parse_arguments(["--input_folder", os.path.join(folder, "mid_interval"), "--output_folder", universal]))
        engine = _zen_engine(universal=True)
        engine.load_checkpoint(folder, tag="universal")
        said_universal = [r.getMessage() for r in records if "brings no ZenFlow state" in r.getMessage()]
        engine.destroy()
        # The mid-interval checkpoint without its ZenFlow key: the run goes on, with the accumulator dropped.
        path = os.path.join(folder, "mid_interval", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
        shard = torch.load(path, weights_only=False)
        del shard["optimizer_state_dict"]["zenflow_state"]
        os.makedirs(os.path.join(folder, "stripped"), exist_ok=True)
        for name in os.listdir(os.path.join(folder, "mid_interval")):
            shutil.copy(os.path.join(folder, "mid_interval", name), os.path.join(folder, "stripped", name))
        torch.save(shard, os.path.join(folder, "stripped", os.path.basename(path)))
        engine = _zen_engine()
        engine.load_checkpoint(folder, tag="stripped")
        _train_steps(engine, range(TAGS["mid_interval"], RESUME_STEPS), 1)
        dropped = _snapshot(engine)["weights"]
        engine.destroy()
    finally:
        logger.removeHandler(handler)
    return {
        "fresh": fresh,
        "said_fresh": said_fresh,
        "said_ignored": said_ignored,
        "said_universal": said_universal,
        "dropped": dropped,
    }


def test_a_checkpoint_without_zenflow_state_loads_afresh_with_a_warning(resume_runs, tmp_path) -> None:
    folder, ranks = resume_runs(1)
    out = run_distributed(_load_without_state, 1, folder, str(tmp_path / "off"))[0]
    assert len(out["said_fresh"]) == 1 and "brings no ZenFlow state" in out["said_fresh"][0], out["said_fresh"]
    assert out["fresh"]["accumulator"] == [None]  # a fresh accumulator, both paths counting on from step 2
    assert [int(s["step"]) for s in out["fresh"]["steps"]] == [2]
    assert any("zero_optimization.zenflow is off" in m for m in out["said_ignored"]), out["said_ignored"]
    assert len(out["said_universal"]) == 1, out["said_universal"]
    # Without the saved accumulator the resumed run is not the uninterrupted one: the exact test above would fail.
    assert not _close(out["dropped"], ranks[0]["final"]["weights"])


def test_zenflow_state_that_does_not_fit_is_refused_naming_zenflow() -> None:
    """Shards saved for other 2-D weights, or with ZenFlow state on some ranks only, are refused before loading."""
    from types import SimpleNamespace

    from deepspeed._core.optim.stage12_state import ZENFLOW_STATE, check_zenflow_shards

    live = SimpleNamespace(zenflow=SimpleNamespace(widths=[4, 8]), groups=[0])
    fits = {ZENFLOW_STATE: {"column_widths": [4, 8], "step_counts": [{}]}}
    check_zenflow_shards(live, [fits, fits])
    check_zenflow_shards(live, [{}, {}])  # no ZenFlow state at all: loaded afresh, with a warning
    other = {ZENFLOW_STATE: {"column_widths": [4, 6], "step_counts": [{}]}}
    for shards in ([other], [fits, {}]):
        with pytest.raises(ValueError, match="zero_optimization.zenflow"):
            check_zenflow_shards(live, shards)
