"""The FLOPs profiler's printed report, in upstream's layout (labels, order and column widths), plus the model FLOPs
utilisation (MFU) against the device's peak where the accelerator knows it."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn

from deepspeed._core.observe.flops_units import (
    DEFAULT_PRECISION,
    duration_to_string,
    flops_to_string,
    get_module_duration,
    get_module_flops,
    get_module_macs,
    macs_to_string,
    number_to_string,
    params_to_string,
)
from deepspeed._core.observe.timers import BACKWARD_GLOBAL_TIMER, FORWARD_GLOBAL_TIMER, STEP_GLOBAL_TIMER
from deepspeed.accelerator import get_accelerator

_LINE = "{:<70}  {:<8}"
_NOTATIONS = (
    "Notations:\n"
    "data parallel size (dp_size), model parallel size(mp_size),\n"
    "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
    "number of floating-point operations (flops), floating-point operations per second (FLOPS),\n"
    "fwd latency (forward propagation latency), bwd latency (backward propagation latency),\n"
    "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n"
)
_DETAILED_LEGEND = (
    "Each module profile is listed after its name in the following order: \n"
    "params, percentage of total params, MACs, percentage of total MACs, fwd latency, percentage of total fwd "
    "latency, fwd FLOPS"
)
_DETAILED_NOTE = (
    "\nNote: 1. A module can have torch.nn.module or torch.nn.functional to compute logits (e.g. CrossEntropyLoss). "
    "They are not counted as submodules, thus not to be printed out. However they make up the difference between a "
    "parent's MACs (or latency) and the sum of its submodules'.\n"
    "2. Number of floating-point operations is a theoretical estimation, thus FLOPS computed using that could be "
    "larger than the maximum system throughput.\n"
    "3. The fwd latency listed in the top module's profile is directly captured at the module forward function in "
    "PyTorch, thus it's less than the fwd latency shown above which is captured in DeepSpeed.\n"
)


def _row(label: str, value: Any) -> str:
    return _LINE.format(label, value)


def _engine_lines(engine: Any) -> list[str]:
    dp = getattr(engine, "dp_world_size", None)
    if dp is None:
        dp = getattr(engine, "seq_dp_world_size", None)
    lines = [
        _row("world size: ", engine.world_size),
        _row("data parallel size: ", dp),
        _row("model parallel size: ", engine.mp_world_size),
        _row("batch size per GPU: ", engine.train_micro_batch_size_per_gpu()),
    ]
    if getattr(engine, "has_moe_layers", False):
        lines.append(_row("expert tensor parallelism enabled: ", False))
    return lines


def _param_lines(prof: Any, total_params: int) -> list[str]:
    mp = prof.ds_engine.mp_world_size if prof.ds_engine is not None else 1
    model = prof.model
    non_expert = int(getattr(model, "__params__", 0)) * mp
    expert = int(getattr(model, "__model_expert_params__", 0))
    lines = [_row("params per GPU: ", params_to_string(total_params))]
    if expert > 0:
        lines += [
            _row("params of model: ", params_to_string(non_expert + expert)),
            _row("   non-expert params of model: ", params_to_string(non_expert)),
            _row("   expert params of model: ", params_to_string(expert)),
        ]
    else:
        lines.append(_row("params of model = params per GPU * mp_size: ", params_to_string(non_expert)))
    return lines


def _timed(engine: Any) -> bool:
    return engine is not None and bool(engine.wall_clock_breakdown())


def _latency_lines(prof: Any, flops: int) -> tuple[list[str], float]:
    """The latency and FLOPS rows; returns them and the FLOPS per GPU the MFU is judged on."""
    engine, r = prof.ds_engine, prof.recompute_fwd_factor
    fwd = prof.get_total_duration()
    if _timed(engine):
        fwd = engine.timers(FORWARD_GLOBAL_TIMER).elapsed(reset=False) / 1000.0
    lines = [
        _row("fwd latency: ", duration_to_string(fwd)),
        _row("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", flops_to_string(flops / fwd if fwd else 0)),
    ]
    achieved = flops / fwd if fwd else 0.0
    if not _timed(engine):
        return lines, achieved
    bwd = engine.timers(BACKWARD_GLOBAL_TIMER).elapsed(reset=False) / 1000.0
    step = engine.timers(STEP_GLOBAL_TIMER).elapsed(reset=False) / 1000.0
    iter_latency = fwd + bwd + step
    bwd_factor = 2 + r
    lines += [
        _row("bwd latency: ", duration_to_string(bwd)),
        _row(
            f"bwd FLOPS per GPU = {bwd_factor:g} * fwd flops per GPU / bwd latency: ",
            flops_to_string(bwd_factor * flops / bwd if bwd else 0),
        ),
        _row(
            f"fwd+bwd FLOPS per GPU = {bwd_factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
            flops_to_string((bwd_factor + 1) * flops / (fwd + bwd) if fwd + bwd else 0),
        ),
        _row("step latency: ", duration_to_string(step)),
        _row("iter latency: ", duration_to_string(iter_latency)),
    ]
    achieved = (bwd_factor + 1) * flops / iter_latency if iter_latency else 0.0
    lines.append(
        _row(f"FLOPS per GPU = {bwd_factor + 1:g} * fwd flops per GPU / iter latency: ", flops_to_string(achieved))
    )
    samples = engine.train_micro_batch_size_per_gpu() * engine.world_size
    lines.append(_row("samples/second: ", round(samples / iter_latency, DEFAULT_PRECISION) if iter_latency else 0))
    return lines, achieved


def _param_dtype(prof: Any) -> torch.dtype:
    first = next(prof.model.parameters(), None)
    return first.dtype if first is not None else torch.float32


def mfu_line(prof: Any, achieved: float) -> str:
    """Model FLOPs utilisation: the achieved FLOPS per GPU over the device's peak for the parameters' dtype."""
    acc = get_accelerator()
    dtype = _param_dtype(prof)
    peak = acc.peak_flops(dtype)
    what = "FLOPS per GPU" if _timed(prof.ds_engine) else "fwd FLOPS per GPU"
    if not peak:
        return _row("MFU: ", f"not computed: no peak FLOPS known for {acc.device_name()} in {dtype}")
    return _row(f"MFU = {what} / device peak ({flops_to_string(peak)}): ", f"{100 * achieved / peak:.2f}%")


def summary_lines(prof: Any, profile_step: int) -> list[str]:
    """Everything above the aggregated profile."""
    flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
    prof.flops, prof.macs, prof.params = flops, macs, params
    mp = prof.ds_engine.mp_world_size if prof.ds_engine is not None else 1
    lines = [
        "\n-------------------------- DeepSpeed Flops Profiler --------------------------",
        f"Profile Summary at step {profile_step}:",
        _NOTATIONS,
    ]
    if prof.ds_engine is not None:
        lines += _engine_lines(prof.ds_engine)
    lines += _param_lines(prof, params)
    lines += [
        _row("fwd MACs per GPU: ", macs_to_string(macs)),
        _row("fwd flops per GPU: ", number_to_string(flops)),
        _row("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(flops * mp)),
    ]
    latency, achieved = _latency_lines(prof, flops)
    return lines + latency + [mfu_line(prof, achieved)]


def aggregated_lines(model: nn.Module, module_depth: int, top_modules: int) -> list[str]:
    """Top ``top_modules`` module classes by params, MACs and fwd latency at each depth."""
    if not hasattr(model, "__flops__"):
        return ["no __flops__ attribute in the model, call this function after start_profile and before end_profile"]
    info: dict[int, dict[str, list[float]]] = {}

    def walk(module: nn.Module, depth: int) -> None:
        row = info.setdefault(depth, {}).setdefault(type(module).__name__, [0, 0, 0.0])
        row[0] += get_module_macs(module)
        row[1] += int(getattr(module, "__params__", 0)) + int(getattr(module, "__expert_params__", 0))
        row[2] += get_module_duration(module)
        for child in module.children():
            walk(child, depth + 1)

    walk(model, 0)
    depth = len(info) - 1 if module_depth == -1 else module_depth
    lines = [f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for d in range(min(depth, len(info))):

        def top(i: int, fmt: Any, d: int = d) -> dict[str, str]:
            ranked = sorted(info[d].items(), key=lambda kv: kv[1][i], reverse=True)[: min(top_modules, len(info[d]))]
            return {k: fmt(v[i]) for k, v in ranked}

        lines += [
            f"depth {d}:",
            f"    params      - {top(1, params_to_string)}",
            f"    MACs        - {top(0, macs_to_string)}",
            f"    fwd latency - {top(2, duration_to_string)}",
        ]
    return lines


def _module_repr(module: nn.Module, totals: tuple[int, int, float], original: Any) -> str:
    total_params, total_macs, total_duration = totals
    params = int(getattr(module, "__params__", 0)) + int(getattr(module, "__expert_params__", 0))
    macs, flops, duration = get_module_macs(module), get_module_flops(module), get_module_duration(module)

    def pct(part: float, whole: float) -> float:
        return round(100 * part / whole, DEFAULT_PRECISION) if whole else 0

    items = [
        f"{params_to_string(params)} = {pct(params, total_params):g}% Params",
        f"{macs_to_string(macs)} = {pct(macs, total_macs):g}% MACs",
        f"{duration_to_string(duration)} = {pct(duration, total_duration):g}% latency",
        flops_to_string(round(flops / duration, DEFAULT_PRECISION) if duration else 0),
    ]
    extra = original()
    return ", ".join(items + ([extra] if extra else []))


def detailed_lines(prof: Any) -> list[str]:
    """The model printed with each module's profile in its ``extra_repr``."""
    totals = (prof.get_total_params(), prof.get_total_macs(), prof.get_total_duration())
    patched = []
    for module in prof.model.modules():
        original = module.extra_repr
        module.extra_repr = lambda m=module, o=original: _module_repr(m, totals, o)
        patched.append(module)
    try:
        text = str(prof.model)
    finally:
        for module in patched:
            del module.extra_repr
    return [
        "\n------------------------------ Detailed Profile per GPU ------------------------------",
        _DETAILED_LEGEND,
        _DETAILED_NOTE,
        text,
    ]


def write_profile(
    prof: Any, profile_step: int, module_depth: int, top_modules: int, detailed: bool, output_file: str | None
) -> None:
    """Write the whole report to standard output, or to ``output_file`` (its directories created)."""
    lines = summary_lines(prof, profile_step)
    lines += ["\n----------------------------- Aggregated Profile per GPU -----------------------------"]
    lines += aggregated_lines(prof.model, module_depth, top_modules)
    if detailed:
        lines += detailed_lines(prof)
    lines.append("------------------------------------------------------------------------------")
    text = "\n".join(lines) + "\n"
    if output_file:
        os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
        with open(output_file, "w") as fd:
            fd.write(text)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()
