"""The monitors (``tensorboard``, ``csv_monitor``, ``wandb``, ``comet``) write what the engine saw, from global rank 0.

TensorBoard files are read back with TensorBoard's own event reader; the CSV files are compared with the losses and
learning rates the training script itself saw; W&B runs offline when the package is installed.
"""

from __future__ import annotations

import csv
import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch

GAS = 2
MICRO = 3


def _config(tmp: str, **blocks: Any) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 4},
        },
        **blocks,
    }


def _train(cfg: dict, steps: int) -> dict:
    """Train ``steps`` optimizer steps; return what the script saw (losses, lr, samples) per optimizer step."""
    import deepspeed
    from deepspeed import comm as dist

    engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
    seen: list[dict] = []
    for step in range(steps):
        losses = []
        for micro in range(GAS):
            loss = engine(*micro_batch(step, GAS * dist.get_rank() + micro))
            losses.append(float(loss))
            engine.backward(loss)
            engine.step()
        seen.append({"loss": sum(losses) / GAS, "lr": engine.get_lr()[0], "samples": engine.global_samples})
    engine.destroy()
    return {"rank": dist.get_rank(), "seen": seen, "world": dist.get_world_size()}


def _read_csv(path: Path) -> tuple[list[str], list[tuple[int, float]]]:
    with open(path, newline="") as fd:
        rows = list(csv.reader(fd))
    return rows[0], [(int(r[0]), float(r[1])) for r in rows[1:]]


def test_csv_holds_the_losses_and_lr_the_script_saw(tmp_path: Path) -> None:
    cfg = _config(str(tmp_path), csv_monitor={"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "j"})
    results = run_distributed(_train, 2, cfg, 3)
    seen = next(r for r in results if r["rank"] == 0)["seen"]
    folder = tmp_path / "csv" / "j"
    header, rows = _read_csv(folder / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"]
    assert [s for s, _ in rows] == [s["samples"] for s in seen]
    assert [s["samples"] for s in seen] == [MICRO * GAS * 2 * (i + 1) for i in range(3)]  # x-axis in samples
    assert [v for _, v in rows] == pytest.approx([s["loss"] for s in seen], rel=1e-6)
    header, rows = _read_csv(folder / "Train_Samples_lr.csv")
    assert header == ["step", "lr"] and [v for _, v in rows] == pytest.approx([s["lr"] for s in seen])
    names = {p.name for p in folder.iterdir()}
    assert {"Train_Samples_samples_per_sec.csv", "Train_Samples_tokens_per_sec.csv"} <= names
    assert {"Train_Samples_mem_allocated_after_forward_GiB.csv", "Train_Samples_mem_floor_GiB.csv"} <= names
    assert "Train_Samples_loss_scale.csv" not in names  # fp32: no loss scale
    _, samples_per_sec = _read_csv(folder / "Train_Samples_samples_per_sec.csv")
    _, tokens_per_sec = _read_csv(folder / "Train_Samples_tokens_per_sec.csv")
    seq = micro_batch(0, 0)[0].shape[1]  # every sample is one sequence of `seq` tokens, on both ranks
    assert [t for _, t in tokens_per_sec] == pytest.approx([seq * s for _, s in samples_per_sec])
    _, floor = _read_csv(folder / "Train_Samples_mem_floor_GiB.csv")
    n = sum(p.numel() for p in make_model(0).parameters())
    assert floor[0][1] == pytest.approx((4 + 4 + 8) * n / 2**30)  # fp32 stage 0: params, grads, Adam moments


def test_tensorboard_events_read_back_with_tensorboards_reader(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = _config(
        str(tmp_path),
        wall_clock_breakdown=True,
        tensorboard={"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "run"},
    )
    results = run_distributed(_train, 2, cfg, 2)
    seen = next(r for r in results if r["rank"] == 0)["seen"]
    log_dir = tmp_path / "tb" / "run"
    files = list(log_dir.glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # rank 0 only
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    timer_tags = {
        f"Train/Samples/elapsed_time_ms_{k}"
        for k in ("forward", "backward", "backward_inner", "backward_allreduce", "step")
    }
    assert {"Train/Samples/lr", "Train/Samples/train_loss"} | timer_tags <= tags, tags
    loss = acc.Scalars("Train/Samples/train_loss")
    assert [e.step for e in loss] == [s["samples"] for s in seen]
    assert [e.value for e in loss] == pytest.approx([s["loss"] for s in seen], rel=1e-5)
    assert all(e.value > 0 for e in acc.Scalars("Train/Samples/elapsed_time_ms_forward"))


def _fp16_loss_scale(tmp: str) -> list:
    import deepspeed

    cfg = _config(
        tmp, fp16={"enabled": True, "initial_scale_power": 5}, csv_monitor={"enabled": True, "output_path": tmp}
    )
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 1e-3}}
    engine, *_ = deepspeed.initialize(model=make_model(0), config=cfg)
    scales = []
    for step in range(2):
        for micro in range(GAS):
            engine.backward(engine(*micro_batch(step, micro)))
            engine.step()
        scales.append(engine.optimizer.cur_scale)
    engine.destroy()
    return scales


def test_fp16_writes_the_loss_scale(tmp_path: Path) -> None:
    scales = run_distributed(_fp16_loss_scale, 1, str(tmp_path))[0]
    _, rows = _read_csv(tmp_path / "DeepSpeedJobName" / "Train_Samples_loss_scale.csv")
    assert [v for _, v in rows] == scales


def _unwritable(cfg: dict) -> str | None:
    import deepspeed

    try:
        deepspeed.initialize(model=make_model(0), config=cfg)
    except Exception as err:  # noqa: BLE001 - the message is what the test checks
        return f"{type(err).__name__}: {err}"
    return None


def _blocked_dir(tmp_path: Path) -> tuple[Path, str]:
    """A directory no file can be created under, and the words the error gives for it."""
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        return locked / "out", "not writable"
    blocker = tmp_path / "file"  # root may write into any directory, but never below a regular file
    blocker.write_text("x")
    return blocker / "out", "is not a directory"


def test_unwritable_output_path_fails_on_every_rank_before_any_collective(tmp_path: Path) -> None:
    target, words = _blocked_dir(tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    try:
        for block in ("tensorboard", "csv_monitor"):
            cfg = _config(str(tmp_path), **{block: {"enabled": True, "output_path": str(target)}})
            # Both ranks must raise: a rank that got past the check would wait in a collective and time out.
            for message in run_distributed(_unwritable, 2, cfg, timeout=60):
                assert message is not None and "DeepSpeedConfigError" in message, message
                assert f"{block}.output_path" in message and words in message, message
        assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing created
    finally:
        if target.parent.is_dir():
            target.parent.chmod(0o700)


def test_access_denied_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from deepspeed._core.observe import monitors

    assert monitors.unwritable_reason(str(tmp_path / "a" / "b")) is None
    monkeypatch.setattr(monitors.os, "access", lambda *_: False)
    reason = monitors.unwritable_reason(str(tmp_path / "a" / "b"))
    assert reason is not None and str(tmp_path) in reason and "not writable" in reason


def test_missing_package_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed._core.config.plan import CometPolicy
    from deepspeed._core.observe import monitors
    from deepspeed._core.observe.preflight import check_outputs
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

    if importlib.util.find_spec("comet_ml") is None:
        plan = DeepSpeedConfig(_config("", comet={"enabled": True})).plan
        with pytest.raises(DeepSpeedConfigError, match="'comet_ml' package.*pip install comet-ml"):
            check_outputs(plan)
        with pytest.raises(ImportError, match="comet_ml"):
            monitors.CometMonitor(CometPolicy(enabled=True))
    monkeypatch.setitem(monitors.PACKAGES, "tensorboard", "no_such_tensorboard_package")
    plan = DeepSpeedConfig(_config("", tensorboard={"enabled": True})).plan
    with pytest.raises(DeepSpeedConfigError, match="tensorboard.enabled=true needs the 'no_such_tensorboard_package'"):
        check_outputs(plan)


def _wandb_offline(tmp: str) -> dict:
    import wandb

    out = _train(_config(tmp, wandb={"enabled": True, "project": "lean-test"}), 2)
    wandb.finish()
    return out


def _wandb_history(run_file: Path) -> list[dict[str, float]]:
    """The logged rows of an offline run's transaction log (a LevelDB-style record log of protobuf records)."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2

    raw, block, pos = run_file.read_bytes(), 32768, 7  # 7: the file's own header
    records, parts = [], []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a record header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        parts = [data] if kind in (1, 2) else parts + [data]
        if kind in (1, 4):
            records.append(b"".join(parts))
    rows = []
    for data in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return rows


def test_wandb_offline_run_logs_what_the_script_saw(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true", "WANDB_DISABLE_CODE": "true"}
    seen = run_distributed(_wandb_offline, 1, str(tmp_path), env=env, timeout=180)[0]["seen"]
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    rows = _wandb_history(run_file)
    assert [row["_step"] for row in rows] == [s["samples"] for s in seen]
    assert [row["Train/Samples/train_loss"] for row in rows] == pytest.approx([s["loss"] for s in seen], rel=1e-6)
    assert [row["Train/Samples/lr"] for row in rows] == pytest.approx([s["lr"] for s in seen])


def _pipe_train(out: str, steps: int) -> list[dict]:
    import deepspeed
    from deepspeed.runtime.pipe.module import PipelineModule
    from tests.dist._pipe_engine_models import data_iter, layer_specs, loss_fn, pipe_config

    module = PipelineModule(layer_specs(), num_stages=2, loss_fn=loss_fn, base_seed=1234, partition_method="uniform")
    cfg = pipe_config(2, csv_monitor={"enabled": True, "output_path": out, "job_name": "pipe"})
    engine, *_ = deepspeed.initialize(model=module, config=cfg)
    it = data_iter(steps, 2, 1, 0)
    seen = [{"loss": float(engine.train_batch(it)), "samples": engine.global_samples} for _ in range(steps)]
    eval_loss = float(engine.eval_batch(data_iter(1, 2, 1, 0, start=steps)))
    seen.append({"eval": eval_loss, "samples": engine.global_samples})
    engine.destroy()
    return seen


def test_pipeline_engine_writes_train_and_eval_loss(tmp_path: Path) -> None:
    seen = run_distributed(_pipe_train, 2, str(tmp_path), 2)[0]
    folder = tmp_path / "pipe"
    _, rows = _read_csv(folder / "Train_Samples_train_loss.csv")
    assert rows == [(s["samples"], pytest.approx(s["loss"], rel=1e-6)) for s in seen[:-1]]
    _, rows = _read_csv(folder / "Train_Samples_eval_loss.csv")
    assert rows == [(seen[-1]["samples"], pytest.approx(seen[-1]["eval"], rel=1e-6))]


class _FakeExperiment:
    def __init__(self) -> None:
        self.name: str | None = None
        self.logged: list[tuple[str, float, int]] = []

    def set_name(self, name: str) -> None:
        self.name = name

    def log_metric(self, name: str, value: float, step: int) -> None:
        self.logged.append((name, value, step))


def test_comet_starts_an_experiment_and_logs_on_the_sample_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from deepspeed._core.config.plan import CometPolicy
    from deepspeed.monitor.comet import CometMonitor

    experiment, started = _FakeExperiment(), {}
    fake = types.ModuleType("comet_ml")
    fake.start = lambda **kwargs: started.update(kwargs) or experiment  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "comet_ml", fake)
    policy = CometPolicy(enabled=True, samples_log_interval=10, project="p", experiment_name="run", online=False)
    monitor = CometMonitor(policy)
    assert started == {
        "api_key": None,
        "project": "p",
        "workspace": None,
        "experiment_key": None,
        "mode": None,
        "online": False,
    }
    assert experiment.name == "run" and monitor.experiment is experiment and monitor.samples_log_interval == 10
    monitor.write_events([("a", 1.0, 4), ("b", 2.0, 4)])
    monitor.write_events([("a", 3.0, 8)])  # 4 samples after the last logged "a": not yet
    monitor.write_events([("a", 5.0, 14), ("b", 6.0, 12)])
    assert experiment.logged == [("a", 1.0, 4), ("b", 2.0, 4), ("a", 5.0, 14)]
