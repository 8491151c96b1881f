"""Lightning's DeepSpeed strategies on one CUDA GPU: train, save, resume, collapse the checkpoint to fp32.

    python benchmarks/clients/lightning_gpu.py --out OUT            # on a CUDA machine with lightning installed
    python benchmarks/clients/lightning_gpu.py --out OUT --smoke    # CPU, seconds: the plumbing without a Trainer

For each of ``Trainer(strategy="deepspeed_stage_2")`` and ``"deepspeed_stage_3"`` a fresh process fits a tiny
regression module for a few steps, saves a checkpoint (a DeepSpeed checkpoint folder), fits again from it for a
few more steps (``ckpt_path=``), and converts the folder with Lightning's
``convert_zero_checkpoint_to_fp32_state_dict``. One JSON record per strategy goes to ``OUT/lightning.jsonl``:
losses, the global step before and after resuming, the engine's and optimizer's classes, whether the converted
weights equal the trained module's, and the error when a phase failed. The smoke mode runs the same module and
loop in plain PyTorch on the CPU (Lightning's DeepSpeed strategy requires CUDA) and records ``"mode": "smoke"``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

STRATEGIES = ("deepspeed_stage_2", "deepspeed_stage_3")
STEPS, MORE_STEPS, BATCH = 12, 6, 16


def _data(n: int = 512) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=gen)
    return torch.utils.data.TensorDataset(x, x @ torch.randn(16, 4, generator=gen) / 4)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))


def _lightning():  # returns a module object
    try:
        import lightning.pytorch as pl
    except ImportError:
        import pytorch_lightning as pl
    return pl


def _module_class(pl):
    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).float(), y.float())  # bf16-mixed casts the batch, targets too
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Regression


def _trainer(pl, strategy: str, steps: int, root: Path):
    return pl.Trainer(
        accelerator="gpu",
        devices=1,
        strategy=strategy,
        max_steps=steps,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=root,
    )


def run_strategy(strategy: str, workdir: Path) -> dict:
    """Fit, save, resume, convert under one strategy (in this process); the record says how far it got."""
    import deepspeed

    record: dict = {"strategy": strategy, "mode": "gpu", "deepspeed": deepspeed.__version__, "torch": torch.__version__}
    loader = torch.utils.data.DataLoader(_data(), batch_size=BATCH, shuffle=False)
    try:
        pl = _lightning()
        record["lightning"] = pl.__version__
        regression = _module_class(pl)
        module, trainer = regression(), _trainer(pl, strategy, STEPS, workdir)
        trainer.fit(module, loader)
        engine = trainer.strategy.deepspeed_engine
        record.update(
            phase="fit",
            losses=module.losses,
            global_step=trainer.global_step,
            engine_is_deepspeed_engine=isinstance(engine, deepspeed.DeepSpeedEngine),
            optimizer_class=f"{type(engine.optimizer).__module__}.{type(engine.optimizer).__name__}",
            zero_stage=engine.zero_optimization_stage(),
        )
        saved = _full_state(engine, module)
        ckpt = workdir / f"{strategy}.ckpt"
        trainer.save_checkpoint(ckpt)
        record.update(phase="save", checkpoint_files=sorted(p.name for p in ckpt.rglob("*") if p.is_file()))
        resumed, trainer2 = regression(), _trainer(pl, strategy, STEPS + MORE_STEPS, workdir)
        trainer2.fit(resumed, loader, ckpt_path=str(ckpt))
        record.update(phase="resume", resumed_losses=resumed.losses, resumed_global_step=trainer2.global_step)
        record.update(_convert(ckpt, workdir / f"{strategy}_fp32.pt", saved))
        record["ok"] = True
    except Exception as err:  # noqa: BLE001 - the record carries the failure
        record.update(ok=False, error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc()[-4000:])
    return record


def _full_state(engine, module) -> dict:
    """The module's full weights (gathered under ZeRO-3) as fp32 CPU tensors."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {k: v.detach().float().cpu().clone() for k, v in module.state_dict().items()}


def _convert(ckpt: Path, out_file: Path, saved: dict) -> dict:
    """Lightning's converter on the checkpoint folder; compares its weights with those at the save."""
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), str(out_file))
    state = torch.load(out_file, map_location="cpu", weights_only=False)["state_dict"]
    common = [k for k in state if k in saved]
    diff = max((float((state[k].float() - saved[k]).abs().max()) for k in common), default=None)
    return {
        "phase": "convert",
        "converted_keys": sorted(state),
        "saved_keys": sorted(saved),
        "keys_compared": len(common),
        "converted_vs_saved_max_abs_diff": diff,
    }


def smoke(workdir: Path) -> dict:
    """The module and data on the CPU in plain PyTorch: the loss must fall (no Lightning, no DeepSpeed)."""
    net, losses = _net(), []
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    for step, (x, y) in enumerate(torch.utils.data.DataLoader(_data(), batch_size=BATCH)):
        if step == STEPS + MORE_STEPS:
            break
        loss = nn.functional.mse_loss(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"strategy": "none", "mode": "smoke", "losses": losses, "ok": sum(losses[-3:]) < sum(losses[:3])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--strategy", choices=STRATEGIES, help="run one strategy in this process (internal)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.out / "lightning_work"
    work.mkdir(exist_ok=True)
    if args.strategy:
        print("RECORD " + json.dumps(run_strategy(args.strategy, work)))
        return
    records = [smoke(work)] if args.smoke else [_in_subprocess(s, args.out) for s in STRATEGIES]
    with open(args.out / "lightning.jsonl", "a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    print(json.dumps([{k: r.get(k) for k in ("strategy", "mode", "ok", "error")} for r in records]))
    sys.exit(0 if all(r["ok"] for r in records) else 1)


def _in_subprocess(strategy: str, out: Path) -> dict:
    """One strategy per fresh process: a failure in one cannot leave state behind for the other."""
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, __file__, "--out", str(out), "--strategy", strategy],
        capture_output=True,
        text=True,
        timeout=280,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RECORD ")]
    record = (
        json.loads(lines[-1][7:])
        if lines
        else {
            "strategy": strategy,
            "ok": False,
            "error": f"exit {done.returncode}, no record",
            "output_tail": (done.stdout + done.stderr)[-4000:],
        }
    )
    record["seconds"] = round(time.perf_counter() - start, 1)
    return record


if __name__ == "__main__":
    main()
