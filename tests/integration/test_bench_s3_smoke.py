"""CPU smoke test of benchmark scenario S3 (ZeRO-3): model shapes, config, one worker per backend.

The GPU run (``bash benchmarks/device_run.sh --scenario s3``) measures; this only checks, on the CPU, that the
Qwen2-shaped models have the parameter counts their shapes say, that the HF-"auto" ZeRO-3 config resolves as
documented, that the worker runs ours at N=1 and FSDP2 at N=8 (fake group, meta-device build) with real hook
counts, and that a trace summary survives the analysis path (the runner's tests: ``test_bench_runner.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
WORKER = BENCH / "scenarios" / "s3_zero3.py"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
if str(BENCH / "scenarios") not in sys.path:
    sys.path.insert(0, str(BENCH / "scenarios"))


def test_qwen_shapes_match_the_built_models() -> None:
    """num_params/layer_params from the shapes equal the parameters of the built model (meta device: no memory)."""
    from models import MODELS, build_model

    expected = {"qwen2-3b": 3_085_938_688, "qwen2.5-7b": 7_615_616_512}
    for name, count in expected.items():
        cfg = MODELS[name]
        assert cfg.num_params() == count
        model = build_model(name, torch.device("meta"), torch.bfloat16)
        unique = {id(p): p for p in model.parameters()}.values()
        assert sum(p.numel() for p in unique) == count
        assert sum(p.numel() for p in model.layers[0].parameters()) == cfg.layer_params()
        assert (model.lm_head.weight is model.embed_tokens.weight) == cfg.tied
    small = build_model("quick-qwen", torch.device("cpu"), torch.float32)
    assert sum(p.numel() for p in small.parameters()) == MODELS["quick-qwen"].num_params()


def test_hf_auto_config_values() -> None:
    """HF Trainer's "auto" resolution for hidden 2048, with offload and the lean-off switches."""
    from _harness import hf_auto_config

    cfg = hf_auto_config({"impl": "ours", "stage": 3, "offload": True}, 2048)
    zero = cfg["zero_optimization"]
    assert zero["stage3_prefetch_bucket_size"] == int(0.9 * 2048 * 2048)
    assert zero["stage3_param_persistence_threshold"] == 20480
    assert zero["reduce_bucket_size"] == 2048 * 2048
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert "offload_param" not in zero and cfg["zero_force_ds_cpu_optimizer"] is False
    off = hf_auto_config({"impl": "ours_leanoff", "stage": 3, "offload_param": True}, 64)["zero_optimization"]
    assert off["lean_stream_ordered_release"] is False and off["offload_param"]["device"] == "cpu"


def _worker(spec: dict, out: Path) -> subprocess.Popen:
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(21000 + os.getpid() % 2000 + spec["world_size"]),
    )
    cmd = [sys.executable, str(WORKER), "--spec", json.dumps(spec), "--result", str(out)]
    return subprocess.Popen(cmd, cwd="/tmp", env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_worker_ours_n1_and_fsdp2_n8(tmp_path: Path) -> None:
    """Both workers (run side by side) finish with status ok, the right parameter count and real gathered-layer
    counts."""
    base = {"model": "quick-qwen", "dtype": "bf16", "gas": 1, "warmup": 1}
    runs = {
        "ours": ({**base, "impl": "ours", "stage": 3, "world_size": 1}, tmp_path / "ours.json"),
        "fsdp2": ({**base, "impl": "fsdp2", "stage": None, "world_size": 8}, tmp_path / "fsdp2.json"),
    }
    procs = {name: _worker(spec, out) for name, (spec, out) in runs.items()}
    for name, proc in procs.items():
        log, _ = proc.communicate(timeout=120)
        record = json.loads(runs[name][1].read_text())
        assert record["status"] == "ok", (record.get("error"), log[-3000:])
        assert record["checkpoint_reentrant"] is False  # ours and FSDP2: non-reentrant by default
        assert record["startup_s"] > 0
        assert record["params"] == record["params_expected"]
        assert record["gathered_probe_error"] is None
        assert record["trace"] == {"skipped": "no CUDA device: no memory-history trace"}
        layers = record["layers"]
        for phase in ("fwd", "bwd"):
            assert 1 <= record[f"gathered_layers_{phase}_max"] <= layers
        assert record["gathered_layers_after_step"] == 0
        times = record["step_times_s"]  # the measured step and two plain ones; the table's time is their median
        assert len(times) == 3 and record["step_time_s"] == sorted(times)[1]
    ours = json.loads(runs["ours"][1].read_text())
    assert ours["gathered_layers_fwd_max"] == 1  # one layer's linears at a time in forward (per-module fetch)
    assert ours["manager_units_alive_after_step"] == 0
    assert ours["floor_bytes_per_param"] == 16.0
    fsdp2 = json.loads(runs["fsdp2"][1].read_text())
    assert fsdp2["gathered_layers_fwd_max"] == 1 and fsdp2["floor_bytes_per_param"] == 2.0


def test_trace_analysis_path_records_a_summary() -> None:
    """A synthetic allocator history goes through the worker's analysis (memory_timeline loaded by path)."""
    import s3_zero3

    assert (s3_zero3.TIMELINE_DIR / "__init__.py").exists()
    frames = [{"filename": "/x/deepspeed/_core/params/gather.py", "name": "gather", "line": 1}]
    trace = [
        {"action": "alloc", "addr": 100, "size": 1000, "frames": frames, "time_us": 1},
        {"action": "free_requested", "addr": 100, "size": 1000, "frames": [], "time_us": 2},
        {"action": "alloc", "addr": 5000, "size": 3000, "frames": [], "time_us": 3},
        {"action": "free_completed", "addr": 100, "size": 1000, "frames": [], "time_us": 4},
    ]
    out = s3_zero3._analyse(
        {"device_traces": [trace], "segments": []}, {"impl": "ours", "model": "quick-qwen"}, 500, lambda mod: []
    )
    assert "error" not in out, out
    assert out["gathered_layers_alive_max_from_trace"] == 2.0
    assert out["deferred_frees"]["gathered_count"] == 1


def test_fake_group_runs_cannot_skip_every_step_unnoticed() -> None:
    """Fake-group outputs are garbage: the config turns the bf16 overflow check off there, and the summary gives a
    run whose every step was skipped no figures instead of its (optimizer-state-free) peak."""
    import summary
    from _harness import hf_auto_config

    assert hf_auto_config({"impl": "ours", "stage": 3, "world_size": 8}, 64)["bf16"]["check_grad_overflow"] is False
    assert "check_grad_overflow" not in hf_auto_config({"impl": "ours", "stage": 3, "world_size": 1}, 64)["bf16"]
    skipped = {
        "scenario": "s3",
        "impl": "ours",
        "status": "ok",
        "stage": 3,
        "model": "qwen2-3b",
        "world_size": 8,
        "skipped_steps": 4,
        "warmup_steps": 2,
        "peak_alloc_gib": 5.0,
        "peak_reserved_gib": 6.0,
    }
    assert summary.figures(skipped)["peak_alloc_gib"] is None
    assert summary.figures(dict(skipped, skipped_steps=0))["peak_alloc_gib"] == 5.0
