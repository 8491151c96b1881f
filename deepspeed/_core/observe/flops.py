"""The FLOPs profiler: floating-point operations, multiply-accumulates, parameters and latency of each module of a
model's forward pass.

Operations are counted by ``torch.utils.flop_counter.FlopCounterMode``, which sees every aten op the forward runs,
whichever Python function called it. Its own formulas count the matrix products, convolutions and attention kernels
(multiply-accumulate kernels: a module's MACs are half their flops); the formulas of ``flop_rules`` add the
element-wise work (activations, norms, softmax, arithmetic, pooling, ...) as flops without MACs, as upstream's
profiler does. Latency comes from forward hooks around every module. Counts are stored on the modules under upstream's
attribute names (``__flops__``, ``__macs__``, ``__params__``, ``__duration__``, ...), each module's own share, so
that ``get_module_flops`` sums a subtree. ``deepspeed.profiling.flops_profiler`` re-exports this module's names.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from deepspeed._core.moe.params import is_moe_param
from deepspeed._core.observe.flop_rules import MATMUL_OPS, RECURRENT_TYPES, counter_mapping, recurrent_counts
from deepspeed._core.observe.flops_report import aggregated_lines, write_profile
from deepspeed._core.observe.flops_units import (
    duration_to_string,
    get_module_duration,
    get_module_flops,
    get_module_macs,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from deepspeed._foundation.logging import logger
from deepspeed.accelerator import get_accelerator

_PROFILE_ATTRS = (
    "__flops__",
    "__macs__",
    "__params__",
    "__expert_params__",
    "__model_expert_params__",
    "__duration__",
    "__start_time__",
    "__hook_flops__",
    "__hook_macs__",
)


def _numel(p: torch.Tensor) -> int:
    return int(getattr(p, "ds_numel", p.numel()))  # a ZeRO-3 parameter's full size, not its local shard


class FlopsProfiler:
    """Measures a model's forward: flops, MACs, parameters and latency per module.

    Args:
        model: the module to profile.
        ds_engine: the engine training it (adds the engine lines and the backward/step latencies to the report).
        recompute_fwd_factor: extra forward work of activation recomputation, as a fraction of one forward.
    """

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0) -> None:
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self.started = False
        self.func_patched = False
        self.flops = 0
        self.macs = 0
        self.params = 0
        self._counter: FlopCounterMode | None = None
        self._handles: list[Any] = []
        self._ignored: tuple[type, ...] = ()

    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Reset the counts and start counting the forward passes that follow."""
        logger.info("Flops profiler started")
        _prime_counter()
        self.reset_profile()
        self._ignored = tuple(ignore_list or ())
        sync = not get_accelerator().use_host_timers()
        for module in self.model.modules():
            if not isinstance(module, self._ignored):
                self._handles.append(module.register_forward_pre_hook(_start_clock(sync)))
                self._handles.append(module.register_forward_hook(_stop_clock(sync)))
                if type(module) in MODULE_HOOK_MAPPING:
                    self._handles.append(module.register_forward_hook(MODULE_HOOK_MAPPING[type(module)]))
        self._counter = FlopCounterMode(display=False, custom_mapping=counter_mapping())
        self._counter.__enter__()
        self.started = True
        self.func_patched = True

    def stop_profile(self) -> None:
        """Stop counting; the counts so far stay on the modules."""
        if self._counter is not None:
            self._collect()
            self._counter.__exit__(None, None, None)
            self._counter = None
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.func_patched = False

    def reset_profile(self) -> None:
        """Zero every module's counts; parameters are counted afresh."""
        for mod in self.model.modules():
            module: Any = mod  # the counts live in attributes torch.nn.Module does not declare
            own = [p for p in module.parameters() if p.requires_grad]
            module.__flops__ = 0
            module.__macs__ = 0
            module.__params__ = sum(_numel(p) for p in own if not is_moe_param(p))
            module.__expert_params__ = sum(_numel(p) for p in own if is_moe_param(p))
            module.__model_expert_params__ = module.__expert_params__
            module.__duration__ = 0.0
            if type(module) in MODULE_HOOK_MAPPING:
                module.__hook_flops__, module.__hook_macs__ = 0, 0

    def end_profile(self) -> None:
        """Stop counting and remove the counts from the modules."""
        if not self.started:
            return
        self.stop_profile()
        self.started = False
        for module in self.model.modules():
            for attr in _PROFILE_ATTRS:
                if hasattr(module, attr):
                    delattr(module, attr)
        logger.info("Flops profiler finished")

    def _collect(self) -> None:
        """Store each module's own flops and MACs (its count less its submodules') from the counter's totals."""
        if self._counter is None:
            return
        counts = self._counter.get_flop_counts()
        root = type(self.model).__name__
        inclusive: dict[nn.Module, tuple[int, int]] = {}
        for name, module in self.model.named_modules():
            per_op = counts.get(f"{root}.{name}" if name else root, {})
            flops = int(sum(per_op.values()))
            inclusive[module] = (flops, int(sum(n for op, n in per_op.items() if op in MATMUL_OPS)) // 2)
        for mod, (flops, macs) in inclusive.items():
            counted: Any = mod  # the counts live in attributes torch.nn.Module does not declare
            if isinstance(counted, self._ignored):
                flops, macs = 0, 0
            children = [inclusive.get(child, (0, 0)) for child in counted.children()]
            counted.__flops__ = max(flops - sum(c[0] for c in children), 0)
            counted.__macs__ = max(macs - sum(c[1] for c in children), 0)
            if hasattr(counted, "__hook_flops__"):  # a module counted by its MODULE_HOOK_MAPPING hook instead
                counted.__flops__, counted.__macs__ = counted.__hook_flops__, counted.__hook_macs__

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward flops of the whole model."""
        self._collect()
        total = get_module_flops(self.model)
        return number_to_string(total) if as_string else total

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Forward multiply-accumulates of the whole model."""
        self._collect()
        total = get_module_macs(self.model)
        return macs_to_string(total) if as_string else total

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Forward latency of the whole model, in seconds."""
        total = get_module_duration(self.model)
        return duration_to_string(total) if as_string else total

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Trainable parameters of the model (expert parameters included)."""
        total = int(getattr(self.model, "__params__", 0)) + int(getattr(self.model, "__expert_params__", 0))
        return params_to_string(total) if as_string else total

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> None:
        """Print the profile (to ``output_file`` instead of standard output when given); nothing unless started."""
        if self.started:
            self._collect()
            write_profile(self, profile_step, module_depth, top_modules, detailed, output_file)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Print the top modules by parameters, MACs and latency at each depth of the module tree."""
        import sys

        self._collect()
        sys.stdout.write("\n".join(aggregated_lines(self.model, module_depth, top_modules)) + "\n")


def _recurrent_hook(module: Any, inputs: tuple[Any, ...], _output: Any) -> None:
    flops, macs = recurrent_counts(module, inputs)
    module.__hook_flops__ += flops
    module.__hook_macs__ += macs


#: Module types counted by a forward hook (``hook(module, inputs, output)`` adding to the module's
#: ``__hook_flops__``/``__hook_macs__``) instead of by the kernels they run: the recurrent modules, whose kernels
#: differ by device (fused on CPU and GPU, element by element elsewhere).
MODULE_HOOK_MAPPING: dict[type, Any] = dict.fromkeys(RECURRENT_TYPES, _recurrent_hook)

_PRIMED = False


def _prime_counter() -> None:
    """Pay the counter's one-off set-up (seconds: lazy imports at its first dispatch) outside the timed forward."""
    global _PRIMED
    if not _PRIMED:
        with FlopCounterMode(display=False, custom_mapping=counter_mapping()):
            torch.mm(torch.ones(1, 1), torch.ones(1, 1))
        _PRIMED = True


def _start_clock(sync: bool) -> Any:
    def hook(module: Any, _inputs: Any) -> None:
        if sync:
            get_accelerator().synchronize()
        module.__start_time__ = time.perf_counter()

    return hook


def _stop_clock(sync: bool) -> Any:
    def hook(module: Any, _inputs: Any, _output: Any) -> None:
        if sync:
            get_accelerator().synchronize()
        module.__duration__ += time.perf_counter() - module.__start_time__

    return hook


def get_model_profile(
    model: nn.Module,
    input_shape: tuple | None = None,
    args: Sequence[Any] = [],  # upstream's default; never mutated
    kwargs: dict = {},  # noqa: B006 - upstream's default; never mutated
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: Sequence[type] | None = None,
    mode: str = "forward",
) -> tuple[Any, Any, Any]:
    """Profile one forward (or ``generate``) of ``model`` after ``warm_up`` unprofiled ones.

    ``input_shape`` builds one uninitialised tensor of the model's parameter dtype and device as the only argument;
    otherwise ``args``/``kwargs`` are passed. Returns ``(flops, macs, params)``, as strings when ``as_string``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode must be 'forward' or 'generate', got {mode!r}")
    model.eval()
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise ValueError(f"get_model_profile: input_shape must be a non-empty tuple, got {input_shape!r}")
        first = next(model.parameters(), None)
        like: dict[str, Any] = {"dtype": first.dtype, "device": first.device} if first is not None else {}
        args = [torch.empty(input_shape, **like)]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, or args and/or kwargs for the model")
    run: Any = model.generate if mode == "generate" else model
    with torch.no_grad():
        for _ in range(warm_up):
            run(*args, **kwargs)
        prof = FlopsProfiler(model)
        prof.start_profile(ignore_list=ignore_modules)
        run(*args, **kwargs)
    flops: Any = prof.get_total_flops()
    macs: Any = prof.get_total_macs()
    params: Any = prof.get_total_params()
    if print_profile:
        prof.print_model_profile(warm_up, module_depth, top_modules, detailed, output_file)
    prof.end_profile()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
