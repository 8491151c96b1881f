"""S3: ZeRO-3 memory: peak, gathered layers alive at once, deferred frees, host memory, step time.

One worker = one (implementation, model, world size, offload). Model: a Qwen2-shaped decoder with random weights
(``models.py``: ``qwen2-3b`` 3.09 B, ``qwen2.5-7b`` 7.62 B, ``quick-qwen`` for CPU), sequence 512, micro-batch 1,
bf16, activation checkpointing inside every decoder layer (``spec["checkpoint_reentrant"]``; by default the
reentrant form for upstream, whose ZeRO-3 fails under the non-reentrant one on the H200 image, and the
non-reentrant form for ours and FSDP2: ``_harness.default_checkpoint_reentrant``; the record says which ran).
DeepSpeed config: what HF Trainer's ``"auto"`` resolves
to (``_harness.hf_auto_config``), optimizer offloaded to pinned CPU memory with ``spec["offload"]`` (parameters
too with ``spec["offload_param"]``, ours only); ``spec["stage"] = 2`` is the ZeRO-2 comparison row. FSDP2:
``fully_shard`` per decoder layer and on the root (``baselines/fsdp2.py``), ``CPUOffloadPolicy(pin_memory=True)``
when offloaded. ``spec["zero"]`` merges config keys into ``zero_optimization`` (an A/B of a documented switch, with
``spec["tag"]`` naming the variant: ``run_all.py --variant``). ``spec["tile_mlp"]`` / ``spec["tile_loss"]``
(tile counts) run every MLP under ``TiledMLP`` and the head with its cross-entropy under ``TiledFusedLogitsLoss``,
imported from whichever ``deepspeed`` the worker runs (the long-sequence rows, with ``spec["seq"]``).
``impl`` ``"plain"`` is the speed floor of ``baselines/plain.py`` (the bare bf16 model under torch AdamW, one rank). At
N > 1 (PyTorch's fake group, rank 0 of N) the DeepSpeed models are built inside ``deepspeed.zero.Init`` and FSDP2's on
the meta device, so the full model never exists on the rank.

Protocol: build + wrap (host RSS sampled) → ``warmup`` steps (2: the first creates the Adam state, upstream
records its prefetch trace in the first and replays it from the second) → the **measured step** (peak counters
reset, host RSS sampled every 2 ms, nothing else instrumented: its peak is the table's) → ``timed_steps - 1`` (2)
more plain steps (the table's step time is the median of these and the measured step's) → one
**instrumented step**: hooks count the decoder layers holding gathered parameters at every module boundary, ours'
parameter manager records its own boundary samples, and on CUDA a memory-history trace
(``torch.cuda.memory._record_memory_history``) is taken and analysed by ``deepspeed/tools/profiling/memory_timeline``
(loaded by path, ``_harness.load_memory_timeline``, so an upstream worker never imports our package).

"Gathered" per implementation: DeepSpeed (ours and upstream) a parameter is gathered when its ``ds_status`` is not
``NOT_AVAILABLE`` (``INFLIGHT`` counts); persistent parameters (``ds_persist``: norms and biases below
``stage3_param_persistence_threshold``) are left out, they are gathered by design. A decoder layer counts when any
of its other parameters is gathered; ``layer-equivalents`` = gathered elements / one layer's elements. FSDP2: a
layer counts when its ``fully_shard`` unit is unsharded or has an all-gather pending.
"""

from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import models
from _harness import (
    MEMORY_TIMELINE_DIR,
    DeepSpeedTrainer,
    GiB,
    RssSampler,
    default_checkpoint_reentrant,
    device,
    hf_auto_config,
    load_memory_timeline,
    mem,
    reset_peak,
    sync,
    worker_main,
)
from floors import bytes_per_param
from models import MODELS, build_model, decoder_layers, random_batch, with_seq, with_tiles

REPO = Path(__file__).resolve().parents[2]
TIMELINE_DIR = Path(MEMORY_TIMELINE_DIR)
BOUNDARY_LIST_MAX = 160  # per-boundary counts kept in the record (forward and backward each)


# ----------------------------------------------------------------------------------------------- build
def _stage(spec: dict) -> int:
    """ZeRO stage of a DeepSpeed spec (3 unless the spec says otherwise; FSDP2 specs carry ``None``)."""
    return int(spec.get("stage") or 3)


def _model(spec: dict) -> str:
    """The model key of ``spec`` (``spec["seq"]`` overrides the shape's sequence length)."""
    name = with_seq(spec["model"], spec.get("seq"))
    return with_tiles(name, int(spec.get("tile_mlp") or 0), int(spec.get("tile_loss") or 0))


def _build(spec: dict) -> tuple[Any, torch.nn.Module, int]:
    """Build and wrap the model; returns (trainer, module as wrapped, parameter count)."""
    cfg = MODELS[_model(spec)]
    ws = int(spec.get("world_size", 1))
    dev = device()
    if spec["impl"] == "fsdp2":
        from baselines.fsdp2 import FSDP2Trainer

        where = torch.device("meta") if ws > 1 else dev
        model = build_model(_model(spec), where, torch.float32)  # FSDP2 keeps fp32 params; bf16 compute
        n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        return FSDP2Trainer(model, spec), model, n
    if spec["impl"] == "plain":  # the speed floor: the bare bf16 model under torch AdamW (baselines/plain.py)
        from baselines.plain import PlainTrainer

        model = build_model(_model(spec), dev, torch.bfloat16)
        return PlainTrainer(model, spec), model, sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    ds_cfg = hf_auto_config(spec, cfg.hidden)
    if ws > 1 and _stage(spec) == 3:
        import deepspeed

        with deepspeed.zero.Init(config_dict_or_path=ds_cfg):
            model = build_model(_model(spec), dev, torch.bfloat16)
    else:
        model = build_model(_model(spec), dev, torch.bfloat16)
    unique = {id(p): p for p in model.parameters()}.values()
    n = sum(int(getattr(p, "ds_numel", p.numel())) for p in unique)
    trainer = DeepSpeedTrainer(model, spec, config=ds_cfg)
    return trainer, trainer.engine.module, n


# ----------------------------------------------------------------------------------------------- layer probe
def _not_available_status() -> Any:
    try:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        return ZeroParamStatus.NOT_AVAILABLE
    except Exception:  # noqa: BLE001 -- fall back to comparing by name
        return None


class LayerProbe:
    """Counts decoder layers holding gathered parameters at module boundaries (hooks outside the checkpoint).

    Forward-pre hooks on every module of each decoder layer (they also fire in the backward recompute) and a
    full-backward-pre hook on each layer; registered after the engine's own hooks, so a sample sees the module's
    parameters already fetched. ``phase`` is set by the caller ("fwd" / "bwd" / "step"); only enabled probes sample.
    """

    def __init__(self, module: torch.nn.Module, impl: str) -> None:
        self.layers = decoder_layers(module)
        self.impl = impl
        self.phase = "idle"
        self.enabled = False
        self.error: str | None = None
        self.samples: dict[str, list[tuple[int, float]]] = {"fwd": [], "bwd": []}
        self.layer_boundaries: dict[str, list[int]] = {"fwd": [], "bwd": []}
        self.handles: list[Any] = []
        self.kind = self._kind()
        if self.kind is None:
            return
        self._not_available = _not_available_status()
        self._tracked = [
            [p for p in layer.parameters() if not getattr(p, "ds_persist", False)] for layer in self.layers
        ]
        self._layer_numel = max(1, sum(int(getattr(p, "ds_numel", p.numel())) for p in self._tracked[0]))
        for index, layer in enumerate(self.layers):
            for sub in layer.modules():
                self.handles.append(sub.register_forward_pre_hook(self._make_hook(index if sub is layer else -1)))
            self.handles.append(layer.register_full_backward_pre_hook(self._make_bwd_hook(index)))

    def _kind(self) -> str | None:
        params = list(self.layers[0].parameters()) if self.layers else []
        if self.impl == "fsdp2":
            return "fsdp2"
        if params and hasattr(params[0], "ds_status"):
            return "deepspeed"
        self.error = "parameters are not ZeRO-3 partitioned (stage < 3): nothing is gathered"
        return None

    def _gathered(self, p: torch.nn.Parameter) -> bool:
        status = p.ds_status
        if self._not_available is not None and type(status) is type(self._not_available):
            return status is not self._not_available
        return getattr(status, "name", str(status)) != "NOT_AVAILABLE"

    def count(self) -> tuple[int, float]:
        """(layers holding gathered parameters, gathered elements in layer-equivalents) right now."""
        if self.kind == "fsdp2":
            from baselines.fsdp2 import layer_unsharded

            alive = sum(1 for layer in self.layers if layer_unsharded(layer))
            return alive, float(alive)
        layers, numel = 0, 0
        for params in self._tracked:
            here = sum(int(p.ds_numel) for p in params if self._gathered(p))
            layers += here > 0
            numel += here
        return layers, numel / self._layer_numel

    def _sample(self, layer_index: int) -> None:
        if not self.enabled or self.error is not None or self.phase not in self.samples:
            return
        try:
            layers, equiv = self.count()
        except Exception as exc:  # noqa: BLE001 -- a probe failure records null with the reason
            self.error = f"{type(exc).__name__}: {exc}"[:300]
            return
        self.samples[self.phase].append((layers, equiv))
        if layer_index >= 0:
            self.layer_boundaries[self.phase].append(layers)

    def _make_hook(self, layer_index: int) -> Any:
        def hook(module: torch.nn.Module, args: Any) -> None:
            self._sample(layer_index)

        return hook

    def _make_bwd_hook(self, layer_index: int) -> Any:
        def hook(module: torch.nn.Module, grad_output: Any) -> None:
            self._sample(layer_index)

        return hook

    def summary(self) -> dict:
        """Max/mean per phase, the per-layer-boundary lists (truncated), or null fields with the reason."""
        out: dict[str, Any] = {"gathered_probe": self.kind, "gathered_probe_error": self.error}
        for phase in ("fwd", "bwd"):
            rows = self.samples[phase]
            ok = self.error is None and bool(rows)
            out[f"gathered_layers_{phase}_max"] = max(r[0] for r in rows) if ok else None
            out[f"gathered_layers_{phase}_mean"] = round(sum(r[0] for r in rows) / len(rows), 3) if ok else None
            out[f"gathered_layer_equiv_{phase}_max"] = round(max(r[1] for r in rows), 3) if ok else None
            out[f"gathered_samples_{phase}"] = len(rows)
            out[f"gathered_layers_{phase}_at_layer_boundaries"] = (
                self.layer_boundaries[phase][:BOUNDARY_LIST_MAX] if ok else None
            )
        return out

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


# ----------------------------------------------------------------------------------------------- ours' manager
def _manager(trainer: Any) -> Any:
    engine = getattr(trainer, "engine", None)
    mgr = getattr(engine, "zero3_manager", None)
    return mgr if mgr is not None and hasattr(mgr, "boundary_samples") else None


def _manager_summary(mgr: Any, samples: list, layer_params: int) -> dict:
    """Ours' own boundary samples (``ZeroParamManager.count_gathered`` at every hook), per phase."""
    out: dict[str, Any] = {"manager_samples": len(samples)}
    phases = {"fwd": ("pre_forward", "post_forward"), "bwd": ("pre_backward", "post_backward")}
    for phase, events in phases.items():
        rows = [s for s in samples if s.event in events]
        out[f"manager_units_alive_{phase}_max"] = max((s.units_alive for s in rows), default=None)
        out[f"manager_units_active_{phase}_max"] = max((s.units_active for s in rows), default=None)
        out[f"manager_layer_equiv_{phase}_max"] = (
            round(max(s.numel_alive for s in rows) / layer_params, 3) if rows else None
        )
    after = mgr.count_gathered("after_step")
    out["manager_params_alive_after_step"] = after.params_alive
    out["manager_units_alive_after_step"] = after.units_alive
    return out


# ----------------------------------------------------------------------------------------------- trace
def load_timeline() -> Any:
    """The ``memory_timeline`` package loaded by path (never through ``import deepspeed``, which may be upstream)."""
    return load_memory_timeline("bench_memory_timeline")


def _png_name(spec: dict) -> str:
    parts = [spec["impl"], spec["model"], f"n{spec.get('world_size', 1)}", f"z{spec.get('stage', 3)}"]
    if spec.get("offload"):
        parts.append("offload")
    if spec.get("offload_param"):
        parts.append("offparam")
    return "trace_" + "_".join(parts).replace(".", "") + ".png"


def _analyse(snapshot: dict, spec: dict, unit_bytes: int, hints: Any = None) -> dict:
    """Summarise a memory-history snapshot (``hints(timeline_module)`` gives its ``category_hints``); errors are
    recorded, never raised."""
    out: dict[str, Any] = {"unit_bytes": unit_bytes}
    try:
        timeline_mod = load_timeline()
    except Exception as exc:  # noqa: BLE001
        return {**out, "error": f"memory_timeline not loadable: {type(exc).__name__}: {exc}"[:500]}
    if hints is not None:
        try:
            snapshot["category_hints"] = hints(timeline_mod)
        except Exception as exc:  # noqa: BLE001 -- without hints, older blocks fall into "before recording"
            out["hints_error"] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        out.update(timeline_mod.summarize(snapshot, device=0, unit_bytes=unit_bytes))
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"summarize: {type(exc).__name__}: {exc}"[:500]
    if spec.get("trace_png") and spec.get("out_dir"):
        try:
            png = Path(spec["out_dir"]) / _png_name(spec)
            title = f"S3 {spec['impl']} {spec['model']} N={spec.get('world_size', 1)}"
            timeline_mod.plot_timeline(timeline_mod.build_timeline(snapshot), str(png), title)
            out["png"] = png.name
        except Exception as exc:  # noqa: BLE001
            out["png_error"] = f"{type(exc).__name__}: {exc}"[:500]
    return out


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


class _LocalView:
    """Module + optimizer as ``memory_timeline.tensor_hints`` reads them, with DTensors (FSDP2) as local shards."""

    def __init__(self, module: torch.nn.Module, optimizer: Any) -> None:
        self._params = [_local(p) for p in module.parameters()]
        self._buffers = list(module.buffers())
        inner = getattr(optimizer, "optimizer", optimizer)
        self.param_groups = [{"params": [_local(p) for p in g["params"]]} for g in inner.param_groups]
        self.state = {i: {k: _local(v) for k, v in st.items()} for i, st in enumerate(inner.state.values())}

    def parameters(self) -> Any:
        return iter(self._params)

    def buffers(self) -> Any:
        return iter(self._buffers)


def _hints(timeline_mod: Any, module: torch.nn.Module, trainer: Any) -> list:
    """Device addresses of parameters, shards, gradients and optimizer state (blocks older than the trace)."""
    if getattr(trainer, "engine", None) is not None:
        return timeline_mod.tensor_hints(module, trainer.engine.optimizer)
    view = _LocalView(module, trainer.optimizer)
    return timeline_mod.tensor_hints(view, view)


def _traced_step(step: Any, spec: dict, unit_bytes: int, module: torch.nn.Module, trainer: Any) -> dict:
    """Run ``step(marks)`` under CUDA memory-history recording and analyse the snapshot."""
    if not torch.cuda.is_available():
        step(None)
        return {"skipped": "no CUDA device: no memory-history trace"}
    max_entries = 2_000_000
    marks: list[dict] = []
    reset_peak()
    t0 = time.perf_counter()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=max_entries)
    try:
        step(marks)
        sync()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    out: dict[str, Any] = {"step_time_s": time.perf_counter() - t0, "peak_alloc_gib": mem()["peak_alloc"]}
    snapshot["recording"] = {"device": torch.cuda.current_device(), "max_entries": max_entries, "phases": marks}
    t1 = time.perf_counter()
    out.update(_analyse(snapshot, spec, unit_bytes, lambda mod: _hints(mod, module, trainer)))
    out["analysis_s"] = round(time.perf_counter() - t1, 2)
    return out


# ----------------------------------------------------------------------------------------------- floors
def floors(spec: dict, params: int, hidden: int, layer_params: int) -> dict:
    """Per-rank model-state floors (``floors.py``) in GiB, and the working-set figures."""
    n = int(spec.get("world_size", 1))
    stage = None if spec["impl"] in ("fsdp2", "plain") else _stage(spec)
    offload, offload_param = bool(spec.get("offload")), bool(spec.get("offload_param"))
    dev_b, host_b = bytes_per_param(spec["impl"], stage, n, offload, offload_param)
    return {
        "floor_bytes_per_param": dev_b,
        "floor_gib": dev_b * params / GiB,
        "host_floor_bytes_per_param": host_b,
        "host_floor_gib": host_b * params / GiB,
        "working_set_layer_gib": 2 * layer_params / GiB,  # one decoder layer gathered in bf16
        "prefetch_bucket_gib": 2 * int(0.9 * hidden * hidden) / GiB,
    }


def _ratios(rec: dict) -> dict:
    floor, peak, res = rec["floor_gib"], rec["peak_alloc_gib"], rec["peak_reserved_gib"]
    ws = rec["working_set_layer_gib"]
    return {
        "peak_over_floor": peak / floor if floor and peak else None,
        "peak_over_floor_plus_layer": peak / (floor + ws) if peak else None,
        "reserved_over_alloc": res / peak if peak else None,
        "peak_minus_before_gib": peak - rec["alloc_before_step_gib"],
    }


# ----------------------------------------------------------------------------------------------- protocol
def _one_step(
    trainer: Any,
    batch: tuple[torch.Tensor, torch.Tensor],
    probe: LayerProbe | None = None,
    early_stop: bool = True,
    marks: list[dict] | None = None,
) -> None:
    """forward, backward, step; ``probe.phase`` follows along, ``marks`` gets the phase times of a trace."""
    ids, labels = batch

    def phase(name: str, mark: str | None) -> None:
        if probe is not None:
            probe.phase = name
        if marks is not None and mark is not None:  # the allocator trace's time_us clock (wall clock)
            marks.append({"name": mark, "time_us": time.time_ns() / 1000.0})

    phase("fwd", "start")
    # torch's non-reentrant checkpoint stops a recompute as soon as the last saved tensor is rebuilt (default on):
    # the last module of each recomputed layer then gets a forward-pre hook but no forward-post hook.
    # spec["checkpoint_early_stop"] = false turns that off, for A/B.
    with nullcontext() if early_stop else torch.utils.checkpoint.set_checkpoint_early_stop(False):
        loss = trainer.loss(ids, labels)
    phase("bwd", "after forward")
    trainer.backward(loss)
    phase("step", "after backward")
    trainer.step()
    phase("idle", "after step")


def _early_stop(spec: dict) -> bool:
    return bool(spec.get("checkpoint_early_stop", True))


def _measured_step(trainer: Any, batch: tuple, spec: dict) -> dict:
    sync()
    before = mem()
    reset_peak()
    with RssSampler() as rss:
        t0 = time.perf_counter()
        _one_step(trainer, batch, early_stop=_early_stop(spec))
        sync()
        step_s = time.perf_counter() - t0
    after = mem()
    return {
        "alloc_before_step_gib": before["alloc"],
        "reserved_before_step_gib": before["reserved"],
        "peak_alloc_gib": after["peak_alloc"],
        "peak_reserved_gib": after["peak_reserved"],
        "alloc_after_step_gib": after["alloc"],
        "reserved_after_step_gib": after["reserved"],
        "step_time_s": step_s,
        "alloc_retries": after["alloc_retries"],
        "_rss_peak": rss.peak,
        "_rss_end": rss.end_rss,
    }


def _instrumented_step(
    trainer: Any, module: torch.nn.Module, spec: dict, batch: tuple, unit_bytes: int, layer_params: int
) -> dict:
    """One more step with the layer probe, ours' manager samples and (CUDA) the memory-history trace."""
    probe = LayerProbe(module, spec["impl"])
    mgr = _manager(trainer)
    if mgr is not None:
        mgr.boundary_samples = []
    probe.enabled = True
    out: dict[str, Any] = {}
    try:
        if spec.get("trace", True):
            out["trace"] = _traced_step(
                lambda marks: _one_step(trainer, batch, probe, _early_stop(spec), marks),
                spec,
                unit_bytes,
                module,
                trainer,
            )
        else:
            _one_step(trainer, batch, probe, _early_stop(spec))
            out["trace"] = {"skipped": "trace disabled in the spec"}
        sync()
    finally:
        probe.enabled = False
        probe.remove()
    out.update(probe.summary())
    try:
        alive_after, _ = probe.count() if probe.kind else (None, None)
    except Exception:  # noqa: BLE001
        alive_after = None
    out["gathered_layers_after_step"] = alive_after
    if mgr is not None:
        samples, mgr.boundary_samples = mgr.boundary_samples, None
        out.update(_manager_summary(mgr, samples, layer_params))
    return out


def run(spec: dict) -> dict:
    """Measure one configuration (see the module docstring)."""
    reentrant = default_checkpoint_reentrant(spec)
    models.CHECKPOINT_USE_REENTRANT = reentrant
    cfg = MODELS[_model(spec)]
    with RssSampler() as init_rss:
        trainer, module, n_params = _build(spec)
        sync()
    rss_before = init_rss.start_rss
    after_init = mem()
    batch = random_batch(cfg, int(spec.get("micro_batch", 1)), device())
    t0 = time.perf_counter()
    for _ in range(int(spec.get("warmup", 2))):
        _one_step(trainer, batch, early_stop=_early_stop(spec))
    sync()
    warm_s = time.perf_counter() - t0
    measured = _measured_step(trainer, batch, spec)
    # Step time: the median of the measured step and ``timed_steps - 1`` more (one step alone moved by up to ~50 %
    # between calls on the H200); memory figures stay the measured step's.
    times = [measured["step_time_s"]]
    for _ in range(max(0, int(spec.get("timed_steps", 3)) - 1)):
        sync()
        t1 = time.perf_counter()
        _one_step(trainer, batch, early_stop=_early_stop(spec))
        sync()
        times.append(time.perf_counter() - t1)
    measured["step_times_s"] = times
    measured["step_time_s"] = sorted(times)[len(times) // 2]
    layer_params = cfg.layer_params()
    rec: dict[str, Any] = {
        "checkpoint_reentrant": reentrant,
        "params": n_params,
        "params_expected": cfg.num_params(),
        "layer_params": layer_params,
        "layers": cfg.layers,
        "model_cfg": cfg.to_dict(),
        "tokens_per_step": cfg.seq * int(spec.get("micro_batch", 1)),
        "alloc_after_init_gib": after_init["alloc"],
        "reserved_after_init_gib": after_init["reserved"],
        "warmup_steps": int(spec.get("warmup", 2)),
        "warmup_s": warm_s,
        **{k: v for k, v in measured.items() if not k.startswith("_")},
        "host_rss_before_build_gib": rss_before / GiB,
        "host_rss_after_init_gib": init_rss.end_rss / GiB,
        "host_rss_init_peak_gib": init_rss.peak / GiB,
        "host_rss_step_peak_gib": measured["_rss_peak"] / GiB,
        "host_bytes_per_param": (measured["_rss_peak"] - rss_before) / n_params,
        "host_init_peak_bytes_per_param": (init_rss.peak - rss_before) / n_params,
        **floors(spec, n_params, cfg.hidden, layer_params),
    }
    rec.update(_ratios(rec))
    rec["prefetch_budget_layers"] = int(0.9 * cfg.hidden * cfg.hidden) / layer_params
    rec.update(_instrumented_step(trainer, module, spec, batch, 2 * layer_params, layer_params))
    rec.update(trainer.info())
    return rec


if __name__ == "__main__":
    worker_main("s3_zero3", run)
