"""Rank bodies of the accelerate integration tests (run in 2 gloo ranks by ``tests/_harness.run_distributed``).

The loop is the one accelerate documents for DeepSpeed: ``Accelerator(deepspeed_plugin=DeepSpeedPlugin(
hf_ds_config=<json with "auto">))``, ``DummyOptim``/``DummyScheduler`` because the JSON defines both, and
``accelerator.accumulate`` + ``accelerator.backward``, which drive the engine through
``set_gradient_accumulation_boundary(is_boundary=...)`` and call ``engine.step()`` only at the boundary.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from tests.integration._common import load_example

MICRO = 4  # samples per micro-batch per rank
LR = 1e-2
WARMUP = 2


def _accelerator(config_path: str, gas: int) -> Any:
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DeepSpeedPlugin

    # As HF Trainer does with use_cpu: the process state is set up for CPU (gloo) first; an Accelerator made with
    # cpu=True would silently drop the DeepSpeed plugin, one made without it on a CPU box would see 1 process.
    PartialState(cpu=True)
    plugin = DeepSpeedPlugin(hf_ds_config=config_path, gradient_accumulation_steps=gas)
    return Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=gas)


def _model() -> torch.nn.Module:
    """The example's tiny GPT-2, seeded; under a ZeRO-3 plugin transformers builds it inside ``zero.Init``."""
    example = load_example()
    torch.manual_seed(0)
    return example.build_model(example.ScriptArguments())


def _prepare(accelerator: Any, total_steps: int) -> tuple[Any, Any, Any, Any, bool]:
    """Build the example's model and data and prepare them; also say whether ``zero.Init`` partitioned the model."""
    from accelerate.utils import DummyOptim, DummyScheduler

    example = load_example()
    model = _model()
    zero_init = all(hasattr(p, "ds_id") for p in model.parameters())
    data = example.CountingDataset(256, 16, 100)
    loader = torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False)
    optimizer = DummyOptim(model.parameters(), lr=LR, weight_decay=0.0)
    # accelerate divides total_num_steps by the number of processes (2) before writing it into the config.
    scheduler = DummyScheduler(optimizer, total_num_steps=total_steps * 2, warmup_num_steps=WARMUP)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    return model, optimizer, loader, scheduler, zero_init


def _train(accelerator: Any, parts: tuple, batches: Any, steps: int, gas: int) -> dict[str, list]:
    """Run ``steps`` optimizer steps of ``gas`` micro-batches; record loss, grad norm, steps and the batches."""
    model, optimizer, _, scheduler, _ = parts
    engine = accelerator.deepspeed_engine_wrapped.engine
    log: dict[str, list] = {"loss": [], "grad_norm": [], "global_steps": [], "inputs": []}
    for _ in range(steps):
        micro_losses, inputs = [], []
        for _ in range(gas):
            batch = next(batches)
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            micro_losses.append(loss.item())
            inputs.append(batch["input_ids"].clone())
        log["loss"].append(sum(micro_losses) / gas)
        log["grad_norm"].append(float(engine.get_global_grad_norm()))
        log["global_steps"].append(engine.global_steps)
        log["inputs"].append(torch.cat(inputs))
    return log


def _reference(config: dict, inputs: list[torch.Tensor], gas: int) -> dict[str, list]:
    """The same optimizer steps through a plain engine loop with one micro-batch of ``gas * MICRO`` samples.

    The model is rebuilt from the same seed (a ZeRO-3 model partitioned by ``zero.Init`` cannot be deep-copied).
    """
    import deepspeed

    initial = _model()
    config = copy.deepcopy(config)
    config.update(train_micro_batch_size_per_gpu=MICRO * gas, gradient_accumulation_steps=1)
    config.pop("train_batch_size", None)
    engine, _, _, _ = deepspeed.initialize(model=initial, model_parameters=initial.parameters(), config=config)
    log: dict[str, list] = {"loss": [], "grad_norm": []}
    for ids in inputs:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        log["loss"].append(loss.item())
        log["grad_norm"].append(float(engine.get_global_grad_norm()))
    engine.destroy()
    return log


def _module_hooks(module: torch.nn.Module) -> int:
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._backward_hooks) + len(m._backward_pre_hooks)
        for m in module.modules()
    )


def _destroy_report(accelerator: Any) -> dict[str, Any]:
    """``free_memory`` must call ``engine.destroy()``: optimizer gone, no ZeRO hook left on the module.

    ZeRO-1/2 hook the parameters' gradients, so a plain backward afterwards must keep its ``.grad``s. ZeRO-3 hooks
    the modules (fetch/release); after ``destroy`` none may remain (the parameters stay partitioned, as upstream).
    """
    engine = accelerator.deepspeed_engine_wrapped.engine
    module = engine.module
    stage = engine.zero_optimization_stage()
    hooks_before = _module_hooks(module)
    accelerator.free_memory()
    report = {
        "wrapper_cleared": accelerator.deepspeed_engine_wrapped is None,
        "optimizer": engine.optimizer,
        "lr_scheduler": engine.lr_scheduler,
        "models_left": len(accelerator._models),
        "hooks_before": hooks_before,
        "hooks_after": _module_hooks(module),
        "grads_kept": None,
    }
    if stage < 3:
        ids = torch.arange(16).unsqueeze(0) % 100
        module.zero_grad(set_to_none=True)
        module(input_ids=ids, labels=ids).loss.backward()
        report["grads_kept"] = all(p.grad is not None for p in module.parameters() if p.requires_grad)
    return report


def train_save_and_teardown(config_path: str, save_dir: str, gas: int, steps: int, save_at: int) -> dict[str, Any]:
    """Train ``steps`` steps with accumulation, ``save_state`` after ``save_at``; compare with a plain engine run
    over the same samples without accumulation; then ``free_memory``. Returns numbers for the parent to assert on."""
    accelerator = _accelerator(config_path, gas)
    parts = _prepare(accelerator, steps)
    batches = iter(parts[2])
    first = _train(accelerator, parts, batches, save_at, gas)
    accelerator.save_state(save_dir)
    second = _train(accelerator, parts, batches, steps - save_at, gas)
    log = {key: first[key] + second[key] for key in first}
    engine = accelerator.deepspeed_engine_wrapped.engine
    result = {
        "loss": log["loss"],
        "grad_norm": log["grad_norm"],
        "global_steps": log["global_steps"],
        "micro_size": tuple(log["inputs"][0].shape),
        "stage": engine.zero_optimization_stage(),
        "gas": engine.gradient_accumulation_steps(),
        "config": dict(accelerator.deepspeed_config),
        "rank": int(os.environ["RANK"]),
    }
    result["zero_init"] = parts[4]
    reference = _reference(accelerator.deepspeed_config, log["inputs"], gas)
    result["ref_loss"], result["ref_grad_norm"] = reference["loss"], reference["grad_norm"]
    result["destroy"] = _destroy_report(accelerator)
    return result


def resume(config_path: str, save_dir: str, gas: int, steps: int, save_at: int) -> dict[str, Any]:
    """A fresh process: ``load_state`` the checkpoint, skip the consumed batches, train the remaining steps."""
    accelerator = _accelerator(config_path, gas)
    parts = _prepare(accelerator, steps)
    accelerator.load_state(save_dir)
    engine = accelerator.deepspeed_engine_wrapped.engine
    loaded_steps = engine.global_steps
    batches = iter(parts[2])
    for _ in range(save_at * gas):
        next(batches)
    log = _train(accelerator, parts, batches, steps - save_at, gas)
    accelerator.free_memory()
    return {
        "loaded_steps": loaded_steps,
        "loss": log["loss"],
        "grad_norm": log["grad_norm"],
        "global_steps": log["global_steps"],
    }
