"""memory_timeline (``deepspeed/tools/profiling/memory_timeline``): stack classification and its rules' paths, the
per-category replay of an allocator trace, deferred frees, the summary, the chart and command line, the config key,
and the core recorder handing its snapshot to the tool (CPU: accepted, nothing recorded)."""

from __future__ import annotations

import ast
import fnmatch
import importlib.util
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from deepspeed.tools.profiling import memory_timeline as mt
from tests._harness import run_distributed

PACKAGE_DIR = Path(mt.__file__).resolve().parent
REPO = PACKAGE_DIR.parents[3]
SITE = "/usr/lib/python3.11/site-packages/"


def fr(path: str, name: str) -> dict:
    """One snapshot frame (innermost first in a stack)."""
    return {"filename": SITE + path, "line": 1, "name": name}


USER = fr("../../home/me/train.py", "main")
CALL = fr("torch/nn/modules/module.py", "_call_impl")
LINEAR = fr("torch/nn/functional.py", "linear")


# ------------------------------------------------------------------------------------------------ classify
@pytest.mark.parametrize(
    "frames, expected",
    [
        # ours
        (
            [
                fr("deepspeed/_core/layout/flat_buffer.py", "alloc_storage"),
                fr("deepspeed/_core/params/gather.py", "_copy_out"),
                fr("deepspeed/_core/params/manager.py", "fetch"),
                CALL,
                USER,
            ],
            "gathered parameters",
        ),
        ([fr("deepspeed/_core/comm/collectives.py", "start_all_gather"), USER], "gathered parameters"),
        ([fr("deepspeed/_core/grads/shard_rows.py", "wire")], "gradients"),
        ([fr("deepspeed/_core/grads/reducer.py", "ensure_accumulator")], "gradients"),
        (
            [fr("deepspeed/_core/optim/master.py", "__init__"), fr("deepspeed/_core/optim/stage12.py", "_build_group")],
            "optimizer state",
        ),
        (
            [
                fr("deepspeed/_core/optim/chunked_step.py", "step_in_chunks"),
                fr("deepspeed/_core/optim/stage12.py", "step"),
            ],
            "optimizer state",
        ),
        (
            [fr("torch/optim/adam.py", "_init_group"), fr("deepspeed/_core/engine/training.py", "step")],
            "optimizer state",
        ),
        (
            [
                fr("deepspeed/_core/layout/inplace_flatten.py", "flatten_params"),
                fr("deepspeed/_core/optim/stage12.py", "_build_group"),
            ],
            "parameters",
        ),
        ([fr("deepspeed/_core/layout/flat_buffer.py", "allocate"), USER], "parameters"),  # helper, nobody decided
        ([fr("deepspeed/_core/params/init_context.py", "_partition_param")], "parameters"),
        # upstream DeepSpeed
        (
            [
                fr("deepspeed/runtime/zero/partition_parameters.py", "_allgather_params_coalesced"),
                fr("deepspeed/runtime/zero/partitioned_param_coordinator.py", "fetch_sub_module"),
                CALL,
            ],
            "gathered parameters",
        ),
        (
            [
                fr("deepspeed/runtime/zero/stage3.py", "__add_grad_to_ipg_bucket"),
                fr("deepspeed/runtime/zero/stage3.py", "reduce_partition_and_remove_grads"),
            ],
            "gradients",
        ),
        ([fr("deepspeed/runtime/zero/stage_1_and_2.py", "average_tensor")], "gradients"),
        (
            [
                fr("deepspeed/runtime/zero/stage3.py", "_create_fp32_partitions"),
                fr("deepspeed/runtime/zero/stage3.py", "_setup_for_real_optimizer"),
            ],
            "optimizer state",
        ),  # innermost decides
        ([fr("deepspeed/runtime/zero/stage3.py", "_optimizer_step")], "optimizer state"),
        ([fr("deepspeed/runtime/zero/partition_parameters.py", "_partition_param")], "parameters"),
        # PyTorch FSDP2
        (
            [
                fr("torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "foreach_all_gather"),
                fr("torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py", "unshard"),
            ],
            "gathered parameters",
        ),
        ([fr("torch/distributed/fsdp/_fully_shard/_fsdp_param.py", "alloc_all_gather_outputs")], "gathered parameters"),
        (
            [
                fr("torch/distributed/fsdp/_fully_shard/_fsdp_param.py", "alloc_storage"),  # as recorded on an H200
                fr("torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py", "wait_for_unshard"),
                fr("torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py", "pre_forward"),
            ],
            "gathered parameters",
        ),
        (
            [
                fr("deepspeed/runtime/zero/partition_parameters.py", "helper"),
                fr("deepspeed/runtime/zero/partitioned_param_coordinator.py", "fetch_sub_module"),
            ],
            "gathered parameters",
        ),
        (
            [
                fr("torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "foreach_reduce"),
                fr("torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py", "post_backward"),
            ],
            "gradients",
        ),
        ([fr("torch/distributed/fsdp/_fully_shard/_fsdp_param.py", "_init_sharded_param")], "parameters"),
        # activations and the rest
        ([LINEAR, CALL, fr("deepspeed/_core/engine/training.py", "forward"), USER], "activations"),
        (
            [LINEAR, CALL, fr("torch/utils/checkpoint.py", "recompute_fn"), fr("torch/autograd/function.py", "apply")],
            "activations",
        ),
        (
            [
                fr("deepspeed/_core/params/gather.py", "_copy_out"),
                fr("deepspeed/_core/params/manager.py", "fetch"),
                CALL,
                fr("torch/utils/checkpoint.py", "recompute_fn"),
            ],
            "gathered parameters",
        ),  # a gather inside a recompute
        ([fr("torch/nn/modules/module.py", "_apply"), fr("torch/nn/modules/module.py", "to"), USER], "parameters"),
        ([USER], "buffers"),
    ],
)
def test_classify_by_allocation_stack(frames: list, expected: str) -> None:
    assert mt.classify(frames, []) == expected


@pytest.mark.parametrize(
    "free_frames, expected",
    [
        ([fr("deepspeed/_core/grads/shard_rows.py", "wire")], "gradients"),
        ([fr("deepspeed/_core/grads/reducer.py", "_on_grad")], "gradients"),
        ([fr("deepspeed/runtime/zero/stage_1_and_2.py", "reduce_ready_partitions_and_remove_grads")], "gradients"),
        ([fr("torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "foreach_reduce")], "gradients"),
        ([fr("torch/optim/optimizer.py", "zero_grad"), USER], "gradients"),
        (
            [
                fr("deepspeed/_core/layout/flat_buffer.py", "free_storage"),
                fr("deepspeed/_core/params/gather.py", "<lambda>"),
                fr("deepspeed/_core/params/gather.py", "drain"),
            ],
            "gathered parameters",
        ),  # deferred release queue
        ([fr("torch/distributed/fsdp/_fully_shard/_fsdp_param.py", "free_unsharded_param")], "gathered parameters"),
        ([fr("deepspeed/runtime/zero/partitioned_param_coordinator.py", "release_sub_module")], "gathered parameters"),
        ([], "activations"),  # backward temporary freed by autograd
        ([fr("torch/autograd/graph.py", "_engine_run_backward")], "activations"),
    ],
)
def test_autograd_allocation_classified_by_free_stack(free_frames: list, expected: str) -> None:
    # Autograd allocates on its device thread: an empty Python stack (C++ frames only when stacks="all").
    cxx_only = [{"filename": "??", "line": 0, "name": "at::native::empty_cuda"}]
    assert mt.classify(cxx_only, free_frames) == expected
    assert mt.classify([fr("torch/autograd/graph.py", "_engine_run_backward")], free_frames) == expected


def test_rules_are_data() -> None:
    decided = {r.category for r in mt.ALLOC_RULES} - {mt.HELPER}
    assert set(mt.CATEGORIES) - {"buffers"} == decided  # buffers: the fallback
    extra = mt.Rule("optimizer state", "my_optim/", ("update*",))
    assert extra.matches(SITE + "my_optim/core.py", "update_moments")
    assert not extra.matches(SITE + "my_optim/core.py", "forward")


def test_helper_rule_lets_the_caller_decide() -> None:
    # ZeroParam's storage helpers allocate for a gather (gathered) as for a partition (parameters).
    helper = fr("deepspeed/_core/params/param.py", "alloc_full")
    assert mt.classify([helper, fr("deepspeed/_core/params/gather.py", "_copy_out")]) == "gathered parameters"
    assert mt.classify([helper, fr("deepspeed/_core/params/gather.py", "partition")]) == "parameters"
    assert mt.classify([helper, USER]) == "parameters"  # nobody decided: the helper table's category


def _defined_names(path: Path) -> set[str]:
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    names: set[str] = set()
    for file in files:
        tree = ast.parse(file.read_text(), filename=str(file))
        names |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if any(isinstance(n, ast.Lambda) for n in ast.walk(tree)):
            names.add("<lambda>")
    return names


OUR_RULES = [
    r
    for table in (mt.ALLOC_RULES, mt.HELPER_RULES, mt.FREE_RULES, mt.BACKWARD_RULES)
    for r in table
    if r.path.startswith(mt.OURS)
]


@pytest.mark.parametrize("rule", OUR_RULES, ids=lambda r: f"{r.path}:{','.join(r.names) or '*'}")
def test_rule_names_an_existing_path_and_functions(rule: mt.Rule) -> None:
    """A rule for this package names a file or room of the tree, and every function it names is defined there."""
    path = REPO / rule.path
    assert path.exists(), f"{rule.path} is not in the tree: update the rule"
    defined = _defined_names(path)
    missing = [p for p in rule.names if not fnmatch.filter(defined, p)]
    assert not missing, f"{rule.path} defines no function {missing}: update the rule"


# ------------------------------------------------------------------------------------------------ synthetic traces
def ev(action: str, addr: int, size: int, t: int, frames: list | None = None) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t, "frames": frames or []}


PARAM_ALLOC = [fr("deepspeed/_core/params/init_context.py", "_partition_param")]
GATHER_ALLOC = [fr("deepspeed/_core/params/gather.py", "_copy_out"), fr("deepspeed/_core/params/manager.py", "fetch")]
ACT_ALLOC = [LINEAR, CALL]
REDUCE_FREE = [fr("deepspeed/_core/grads/shard_rows.py", "wire")]


def snapshot(trace: list[dict], segments: list | None = None, **extra: object) -> dict:
    return {"segments": segments or [], "device_traces": [trace], **extra}


def step_trace() -> list[dict]:
    return [
        ev("alloc", 0x1000, 100, 1_000, PARAM_ALLOC),  # 0 parameters
        ev("alloc", 0x2000, 1000, 1_010, GATHER_ALLOC),  # 1 gathered
        ev("alloc", 0x3000, 50, 1_020, ACT_ALLOC),  # 2 activation -> peak 1150
        ev("free_requested", 0x2000, 1000, 1_030),  # 3
        ev("free_completed", 0x2000, 1000, 1_030),  # 4 prompt free
        ev("alloc", 0x4000, 300, 1_040),  # 5 autograd .grad (empty stack)
        ev("free_requested", 0x4000, 300, 1_050, REDUCE_FREE),
        ev("free_completed", 0x4000, 300, 1_050),  # 7
        ev("free_requested", 0x3000, 50, 1_060),
        ev("free_completed", 0x3000, 50, 1_061),  # 9
    ]


def test_timeline_live_bytes_per_category_and_peak() -> None:
    tl = mt.build_timeline(snapshot(step_trace()))
    assert tl.time_unit == "us"
    assert list(tl.entry_index) == [-1, 0, 1, 2, 4, 5, 7, 9]
    assert list(tl.times) == [0.0, 0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 61.0]
    assert list(tl.total) == [0, 100, 1100, 1150, 150, 450, 150, 100]
    assert tl.peak_index == 3
    assert tl.at(3) == {
        "parameters": 100,
        "gathered parameters": 1000,
        "gradients": 0,
        "optimizer state": 0,
        "activations": 50,
        "buffers": 0,
        "before recording": 0,
    }
    assert list(tl.live["gradients"]) == [0, 0, 0, 0, 0, 300, 0, 0]  # decided by its free stack


def test_trace_without_timestamps_uses_entry_index() -> None:
    trace = [{k: v for k, v in e.items() if k != "time_us"} for e in step_trace()]
    tl = mt.build_timeline(snapshot(trace))
    assert tl.time_unit == "entry" and list(tl.times) == [0.0, 0.0, 1.0, 2.0, 4.0, 5.0, 7.0, 9.0]


def test_deferred_free_counted_prompt_free_not() -> None:
    trace = [
        ev("alloc", 0xA000, 1000, 10, GATHER_ALLOC),
        ev("alloc", 0xB000, 1000, 11, GATHER_ALLOC),
        ev("free_requested", 0xA000, 1000, 20),  # 2: request ...
        ev("alloc", 0xC000, 64, 21, ACT_ALLOC),  # 3: ... the program goes on ...
        ev("free_requested", 0xB000, 1000, 22),  # 4: prompt: completes right away
        ev("free_completed", 0xB000, 1000, 22),  # 5
        ev("free_completed", 0xA000, 1000, 90),  # 6: ... completion only here (record_stream style)
        ev("free_requested", 0xC000, 64, 95),
        ev("free_completed", 0xC000, 64, 96),
    ]
    got = mt.deferred_frees(snapshot(trace))
    assert got["count"] == 1 and got["bytes"] == 1000 and got["gathered_count"] == 1
    assert got["max_delay_us"] == 70.0 and got["max_delay_entries"] == 4 and got["pending_at_end"] == 0
    # The deferred block still counts until its free completes: both gathered blocks are live at entry 4.
    tl = mt.build_timeline(snapshot(trace))
    assert max(tl.live["gathered parameters"]) == 2000


def test_free_still_pending_at_end_is_deferred() -> None:
    trace = [
        ev("alloc", 0xA000, 500, 1, GATHER_ALLOC),
        ev("free_requested", 0xA000, 500, 2),
        ev("alloc", 0xB000, 8, 3, ACT_ALLOC),
    ]
    got = mt.deferred_frees(snapshot(trace))
    assert got["count"] == 1 and got["pending_at_end"] == 1 and got["gathered_bytes"] == 500
    assert mt.build_timeline(snapshot(trace)).total[-1] == 508


def test_summarize_gathered_max_and_unit_ratio() -> None:
    trace = [ev("alloc", 0x100 * i, 1000, i, GATHER_ALLOC) for i in range(1, 4)]
    trace += [
        ev("free_requested", 0x100, 1000, 10),
        ev("free_completed", 0x100, 1000, 10),
        ev("alloc", 0x900, 1000, 11, GATHER_ALLOC),
    ]
    summary = mt.summarize(snapshot(trace), unit_bytes=1000)
    assert summary["gathered_max_bytes"] == 3000
    assert summary["gathered_layers_alive_max_from_trace"] == 3.0
    assert summary["peak_allocated_bytes"] == 3000 and summary["events"] == 6
    assert summary["deferred_frees"]["count"] == 0
    assert mt.summarize(snapshot(trace))["gathered_layers_alive_max_from_trace"] is None
    json.dumps(summary)  # JSON-serialisable


def test_blocks_from_before_recording_are_a_baseline() -> None:
    segments = [
        {
            "device": 0,
            "address": 0x10000,
            "total_size": 4096,
            "stream": 0,
            "segment_type": "small",
            "blocks": [
                {"address": 0x10000, "size": 1024, "requested_size": 1000, "state": "active_allocated", "frames": []},
                {"address": 0x10400, "size": 1024, "requested_size": 1024, "state": "inactive", "frames": []},
                {
                    "address": 0x10800,
                    "size": 512,
                    "requested_size": 512,
                    "state": "active_allocated",
                    "frames": [fr("torch/optim/adam.py", "_init_group")],
                },
                {"address": 0x10A00, "size": 512, "requested_size": 512, "state": "active_allocated", "frames": []},
                {
                    "address": 0x10C00,
                    "size": 1024,
                    "requested_size": 1024,
                    "state": "active_allocated",
                    "frames": ACT_ALLOC,
                },  # allocated inside the trace (below): not a baseline block
            ],
        }
    ]
    trace = [
        ev("free_requested", 0x20000, 256, 5, REDUCE_FREE),  # alive before recording, freed on a reduce path
        ev("free_completed", 0x20000, 256, 5),
        ev("free_requested", 0x30000, 64, 6),  # alive before recording, unknown origin
        ev("free_completed", 0x30000, 64, 6),
        ev("free_requested", 0x40000, 2048, 6, [fr("deepspeed/_core/params/gather.py", "free")]),
        ev("free_completed", 0x40000, 2048, 6),  # gathered in the previous step, released now
        ev("alloc", 0x10C00, 1024, 7, ACT_ALLOC),
    ]
    hints = [{"address": 0x10A00 + 16, "size": 128, "category": "parameters"}]
    snap = snapshot(trace, segments, category_hints=hints)
    tl = mt.build_timeline(snap)
    assert tl.at(0) == {
        "parameters": 512,
        "gathered parameters": 2048,
        "gradients": 256,
        "optimizer state": 512,
        "activations": 0,
        "buffers": 0,
        "before recording": 1000 + 64,
    }
    assert tl.total[-1] == 1000 + 512 + 512 + 1024
    summary = mt.summarize(snap)
    assert summary["freed_blocks_from_before_recording"] == {"count": 3, "bytes": 256 + 64 + 2048}
    assert summary["start_by_category"]["before recording"] == 1064


def test_ring_buffer_warning_and_oom() -> None:
    trace = step_trace() + [{"action": "oom", "size": 1 << 30, "device_free": 0, "time_us": 2000, "frames": []}]
    summary = mt.summarize(snapshot(trace, recording={"max_entries": len(trace), "phases": []}))
    assert any("max_entries" in w for w in summary["warnings"])
    assert any("out-of-memory" in w for w in summary["warnings"])
    assert not mt.summarize(snapshot(step_trace()))["warnings"]


def test_phase_marks_place_the_peak() -> None:
    phases = [
        {"name": "start", "time_us": 1_000},
        {"name": "after forward", "time_us": 1_025},
        {"name": "after backward", "time_us": 1_055},
    ]
    summary = mt.summarize(snapshot(step_trace(), recording={"phases": phases}))
    assert summary["peak_after_phase"] == "start"  # the peak (t=1020) is inside the forward
    assert [p["time"] for p in summary["phases"]] == [0.0, 25.0, 55.0]


class _Dev:
    def __init__(self, kind: str) -> None:
        self.type = kind


class _T:
    """Duck-typed tensor: what tensor_hints reads."""

    def __init__(self, ptr: int, numel: int, kind: str = "cuda") -> None:
        self.ptr, self.n, self.device, self.grad = ptr, numel, _Dev(kind), None

    def data_ptr(self) -> int:
        return self.ptr

    def numel(self) -> int:
        return self.n

    def element_size(self) -> int:
        return 2


def test_tensor_hints_from_module_and_optimizer() -> None:
    p, master, moment, host = _T(0x100, 10), _T(0x900, 10), _T(0xA00, 10), _T(0xB00, 10, "cpu")
    p.grad = _T(0x500, 10)
    dtensor = _T(0, 40)  # FSDP2 parameter: a DTensor whose storage is its local shard
    dtensor._local_tensor = _T(0xC00, 10)

    class Module:
        def parameters(self) -> list:
            return [p, dtensor]

        def buffers(self) -> list:
            return [host]

    class Inner:
        param_groups = [{"params": [master, p]}]
        state = {master: {"exp_avg": moment, "step": 3}}

    class Wrapper:
        optimizer = Inner()

    hints = {h["address"]: h["category"] for h in mt.tensor_hints(Module(), Wrapper())}
    assert hints == {
        0x100: "parameters",
        0x500: "gradients",
        0x900: "optimizer state",
        0xA00: "optimizer state",
        0xC00: "parameters",
    }


# ------------------------------------------------------------------------------------------------ chart and CLI
def test_plot_writes_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is not installed here (pip install matplotlib)")
    png = tmp_path / "t.png"
    mt.plot_timeline(mt.build_timeline(snapshot(step_trace())), str(png), title="synthetic")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(RuntimeError, match="pip install matplotlib"):
        mt.plot_timeline(mt.build_timeline(snapshot(step_trace())), str(tmp_path / "t.png"))


def test_cli_on_pickled_snapshot_without_deepspeed_on_path(tmp_path: Path) -> None:
    snap = tmp_path / "snap.pickle"
    snap.write_bytes(pickle.dumps(snapshot(step_trace())))
    out = tmp_path / "summary.json"
    # -I: isolated mode (no PYTHONPATH, no cwd on sys.path), run from an unrelated directory: the package directory
    # itself is the program, as where another DeepSpeed is the importable one.
    proc = subprocess.run(
        [sys.executable, "-I", str(PACKAGE_DIR), str(snap), "--json", str(out), "--unit-bytes", "500"],
        check=False,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    printed = json.loads(proc.stdout)
    assert printed == json.loads(out.read_text())
    assert printed["peak_allocated_bytes"] == 1150 and printed["gathered_layers_alive_max_from_trace"] == 2.0


def test_cli_as_module(tmp_path: Path) -> None:
    snap = tmp_path / "snap.pickle"
    snap.write_bytes(pickle.dumps(snapshot(step_trace())))
    proc = subprocess.run(
        [sys.executable, "-m", "deepspeed.tools.profiling.memory_timeline", str(snap)],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["peak_allocated_bytes"] == 1150


def test_loads_by_file_path_without_torch_or_deepspeed(tmp_path: Path) -> None:
    init = PACKAGE_DIR / "__init__.py"
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('ds_lean_memory_timeline', {str(init)!r},\n"
        f"    submodule_search_locations=[{str(PACKAGE_DIR)!r}])\n"
        "mod = importlib.util.module_from_spec(spec)\n"
        "sys.modules[spec.name] = mod\n"
        "spec.loader.exec_module(mod)\n"
        "assert mod.classify([], []) == 'activations'\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'deepspeed', 'matplotlib'))\n"
        "assert not bad, bad\n"
        "print(mod.CATEGORIES)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-I", "-c", code], check=False, capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "gathered parameters" in proc.stdout
    assert importlib.util.find_spec("deepspeed") is not None  # the check above ran without it on purpose


# ------------------------------------------------------------------------------------------------ config and engine
BASE = {"train_batch_size": 2}


def test_config_key_accepted_and_planned() -> None:
    plan = DeepSpeedConfig({**BASE, "memory_timeline": {"enabled": True, "step": 3, "path": "out/mt"}}).plan
    assert (plan.memory_timeline.enabled, plan.memory_timeline.step, plan.memory_timeline.path) == (True, 3, "out/mt")
    default = DeepSpeedConfig(BASE).plan.memory_timeline
    assert (default.enabled, default.step, default.path) == (False, 2, "memory_timeline")


def test_config_unknown_sub_key_names_it() -> None:
    with pytest.raises(DeepSpeedConfigError, match=r"memory_timeline.*'stpe'.*did you mean 'step'"):
        DeepSpeedConfig({**BASE, "memory_timeline": {"enabled": True, "stpe": 2}})


def test_config_step_must_be_positive() -> None:
    with pytest.raises(DeepSpeedConfigError, match=r"memory_timeline\.step"):
        DeepSpeedConfig({**BASE, "memory_timeline": {"enabled": True, "step": 0}})


def _train_with_timeline(out_prefix: str) -> dict:
    import logging

    import torch

    import deepspeed
    from deepspeed.utils.logging import logger

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "memory_timeline": {"enabled": True, "step": 2, "path": out_prefix},
        }
        engine, *_ = deepspeed.initialize(model=model, config=config)
        for _ in range(3 * 2):
            loss = engine(torch.randn(2, 4)).pow(2).mean()
            engine.backward(loss)
            engine.step()
        steps = engine.global_steps
        engine.destroy()
    finally:
        logger.removeHandler(handler)
    return {"steps": steps, "warnings": [r for r in records if "memory_timeline" in r]}


def test_engine_on_cpu_accepts_key_and_warns_once(tmp_path: Path) -> None:
    (result,) = run_distributed(_train_with_timeline, 1, str(tmp_path / "mt"))
    assert result["steps"] == 3
    assert len(result["warnings"]) == 1 and "needs a CUDA device" in result["warnings"][0]
    assert not list(tmp_path.iterdir())  # nothing recorded, nothing written


class _RecordingAccelerator:
    """What the core recorder asks of the accelerator, with a canned snapshot (as a CUDA device would give)."""

    def __init__(self, snap: dict) -> None:
        self.snap, self.history = snap, []

    def memory_history_supported(self) -> bool:
        return True

    def record_memory_history(self, enabled: bool, max_entries: int | None = None) -> None:
        self.history.append(enabled)

    def memory_snapshot(self) -> dict:
        return dict(self.snap)

    def current_device(self) -> int:
        return 0

    def device_name(self) -> str:
        return "fake"


@pytest.mark.parametrize("with_analyser", [True, False], ids=["facade-analyser", "snapshot-only"])
def test_core_recorder_writes_the_snapshot_and_hands_it_to_the_tool(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, with_analyser: bool
) -> None:
    import torch

    from deepspeed._core.config.plan import MemoryTimelinePolicy
    from deepspeed._core.engine import memory

    fake = _RecordingAccelerator(snapshot(step_trace()))
    monkeypatch.setattr(memory, "get_accelerator", lambda: fake)
    policy = MemoryTimelinePolicy(enabled=True, step=2, path=str(tmp_path / "out" / "mt"))
    recorder = memory.TimelineRecorder(policy, mt.TimelineAnalyser() if with_analyser else None)
    recorder.begin(0)
    assert fake.history == [] and recorder.finish(1, torch.nn.Linear(2, 2), None) is None  # not the step yet
    recorder.begin(1)
    recorder.mark("after forward")
    summary = recorder.finish(2, torch.nn.Linear(2, 2), None)
    assert fake.history == [True, False]
    prefix = tmp_path / "out" / "mt_rank0"
    written = pickle.loads(prefix.with_suffix(".pickle").read_bytes())
    assert [p["name"] for p in written["recording"]["phases"]] == ["start", "after forward"]
    if not with_analyser:
        assert summary is None and recorder.written == [str(prefix.with_suffix(".pickle"))]
        assert "category_hints" not in written
        return
    assert written["category_hints"] == []  # a CPU module: no device addresses
    assert summary["peak_allocated_bytes"] == 1150
    assert json.loads(prefix.with_suffix(".json").read_text()) == summary
    assert recorder.written[:2] == [str(prefix.with_suffix(".pickle")), str(prefix.with_suffix(".json"))]
