"""Universal-checkpoint conversion of a real ZeRO-3 checkpoint: wall time and the converter's peak host memory.

    PYTHONPATH=. python benchmarks/universal_convert_gpu.py --layers 18 --work /tmp/universal --out OUT.json

Trains one step of the Qwen2-shaped decoder of ``benchmarks/models.py`` with ``--layers`` layers (hidden 2048, bf16,
ZeRO-3 on one device, fp32 Adam states), saves a checkpoint with ``save_checkpoint``, then runs the converter users
run (``python -m deepspeed.checkpoint.ds_to_universal --input_folder ... --output_folder ...``) in a child process
and samples that process's resident set every 10 ms. The record: parameters, checkpoint and universal folder sizes,
save and conversion seconds, the converter's peak resident set (absolute and per parameter).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
GiB = float(1 << 30)


def _folder_gib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / GiB


def _save(args: argparse.Namespace, ckpt: Path) -> tuple[int, float]:
    import torch

    import deepspeed
    from models import MODELS, build_model

    MODELS["universal"] = dataclasses.replace(MODELS[args.model], layers=args.layers, seq=args.seq)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model("universal", device, torch.bfloat16)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5}},
        "zero_optimization": {"stage": 3},
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    ids = torch.randint(0, MODELS["universal"].vocab, (1, args.seq + 1)).to(device)
    engine.backward(engine(ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    engine.step()
    start = time.perf_counter()
    engine.save_checkpoint(str(ckpt), tag="step1")
    seconds = time.perf_counter() - start
    engine.destroy()
    return params, seconds


def _convert(ckpt: Path, universal: Path) -> tuple[float, int]:
    import psutil

    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(ckpt / "step1"),
        "--output_folder",
        str(universal),
    ]
    start = time.perf_counter()
    child = subprocess.Popen(cmd)
    proc, peak = psutil.Process(child.pid), 0
    while child.poll() is None:
        try:
            peak = max(peak, proc.memory_info().rss)
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)
    if child.returncode != 0:
        raise SystemExit(f"the converter exited with {child.returncode}")
    return time.perf_counter() - start, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2-3b", help="the layer shape (a key of models.MODELS)")
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--work", type=Path, default=Path("/tmp/universal_bench"))
    ap.add_argument(
        "--universal-dir",
        type=Path,
        default=None,
        help="where the converter writes (default: under --work): another file system when one cannot hold both",
    )
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(BENCH))
    from _harness import one_rank_env

    one_rank_env(29533)
    shutil.rmtree(args.work, ignore_errors=True)
    ckpt = args.work / "ckpt"
    universal = args.universal_dir if args.universal_dir is not None else args.work / "universal"
    shutil.rmtree(universal, ignore_errors=True)
    _check_room(args, ckpt, universal)
    params, save_s = _save(args, ckpt)
    convert_s, peak = _convert(ckpt, universal)
    record = {
        "layers": args.layers,
        "params": params,
        "save_s": round(save_s, 1),
        "convert_s": round(convert_s, 1),
        "converter_peak_rss_gib": peak / GiB,
        "converter_peak_rss_bytes_per_param": peak / params,
        "checkpoint_gib": _folder_gib(ckpt),
        "universal_gib": _folder_gib(universal),
        "universal_dir": str(universal),
    }
    print(json.dumps(record))
    args.out.write_text(json.dumps(record) + "\n")
    shutil.rmtree(args.work, ignore_errors=True)
    shutil.rmtree(universal, ignore_errors=True)


def _check_room(args: argparse.Namespace, ckpt: Path, universal: Path) -> None:
    """Stop before training when the folders' file systems cannot hold the checkpoint (about 14 bytes per
    parameter: 16-bit weights, fp32 master and two moments) and the universal folder (about 12)."""
    from models import MODELS

    shape = dataclasses.replace(MODELS[args.model], layers=args.layers)
    params = shape.num_params()
    need = {ckpt: 14 * params, universal: 12 * params}
    for folder in (ckpt, universal):
        folder.mkdir(parents=True, exist_ok=True)
    devices: dict[int, int] = {}
    for folder, nbytes in need.items():
        devices[folder.stat().st_dev] = devices.get(folder.stat().st_dev, 0) + nbytes
    for folder in need:
        free = shutil.disk_usage(folder).free
        wanted = devices[folder.stat().st_dev]
        if free < wanted:
            raise SystemExit(f"{folder}: {free / GiB:.1f} GiB free, about {wanted / GiB:.1f} GiB needed")


if __name__ == "__main__":
    main()
