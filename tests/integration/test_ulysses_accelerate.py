"""accelerate's Ulysses sequence-parallel route on our engine (2 CPU ranks over gloo, one SP group of 2).

``Accelerator(parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed", sp_handler=
DeepSpeedSequenceParallelConfig(...)), deepspeed_plugin=...)`` prepares a tiny Hugging Face Llama (sdpa core
attention), an SGD optimizer and a DataLoader. accelerate then calls ``UlyssesSPAttentionHF.register_with_transformers``
on the model, wraps the loader in ``UlyssesSPDataLoaderAdapter`` and passes the SP mpu to ``deepspeed.initialize``.
Two SGD steps (clipping off) on the sequence's mean token loss (loss sums gathered over the SP group, as the HF
Trainer does) must give exactly the losses and parameters of one process training on the whole sequences: this is
full parity, not only a shape check. Both routes run at ZeRO-2 and ZeRO-3 (parameters gathered to compare). The
test also checks that the engine got the SP mpu and that each batch is a half-length shard of the sequence.
"""

from __future__ import annotations

import pytest
import torch

from tests._harness import run_distributed
from tests.dist._sp_models import batch, loss_sum_and_count, shifted, sp_mean_loss, tiny_llama
from tests.integration._common import QUIET_ENV, missing_integration_packages

pytestmark = pytest.mark.skipif(missing_integration_packages() is not None, reason=missing_integration_packages() or "")

LR, MICRO, SEQ, STEPS = 0.5, 1, 8, 2
TIMEOUT = 240.0


def _ds_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 64, "allgather_bucket_size": 64},
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
    }


def _batches() -> list[dict]:
    """One sample per batch, one batch per optimizer step (accelerate hands batch i to rank i % 2)."""
    return [{k: v[0] for k, v in batch(20 + i, 1, SEQ).items()} for i in range(STEPS)]


def _full_params(engine) -> dict:
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):  # ZeRO-3: each rank holds a shard
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _accelerator(stage: int):
    from accelerate import Accelerator, PartialState
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedPlugin, DeepSpeedSequenceParallelConfig

    PartialState(cpu=True)  # gloo process state first, as in the other accelerate tests
    handler = DeepSpeedSequenceParallelConfig(sp_seq_length=SEQ, sp_attn_implementation="sdpa")
    config = ParallelismConfig(sp_size=2, sp_backend="deepspeed", sp_handler=handler)
    return Accelerator(parallelism_config=config, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=_ds_config(stage)))


def _train_sp(stage: int) -> dict:
    import deepspeed.comm as dist
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    accelerator = _accelerator(stage)
    model = tiny_llama("sdpa")
    loader = torch.utils.data.DataLoader(_batches(), batch_size=MICRO, shuffle=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    engine = accelerator.deepspeed_engine_wrapped.engine
    group = parallel_state_sp.get_sequence_parallel_group()
    report = {
        "mpu_is_sp": engine.mpu.get_sequence_parallel_group() is group and engine.seq_parallel_group is group,
        "seq_parallel_size": engine.sequence_parallel_size,
        "loader_len": len(loader),
        "shapes": [],
        "loss": [],
    }
    for micro in loader:
        report["shapes"].append(tuple(micro["input_ids"].shape))
        loss = sp_mean_loss(model, {k: v.to(accelerator.device) for k, v in micro.items()}, group)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        report["loss"].append(loss.item())
    report["params"] = _full_params(engine)
    report["stage"] = engine.zero_optimization_stage()
    report["rank"] = dist.get_rank()
    parallel_state_sp._release_sequence_parallel_groups()
    return report


def _reference() -> dict:
    """One process, whole sequences, the same batches in the same order."""
    model = tiny_llama("sdpa")
    losses = []
    for sample in _batches():
        b = {k: v.unsqueeze(0) for k, v in sample.items()}
        s, c = loss_sum_and_count(model, b["input_ids"], b["position_ids"], shifted(b["labels"]))
        loss = s / c
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
                p.grad = None
        losses.append(loss.item())
    return {"loss": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_sp2_matches_whole_sequence(stage: int) -> None:
    results = run_distributed(_train_sp, 2, stage, timeout=TIMEOUT, env=QUIET_ENV)
    ref = _reference()
    for rank, got in enumerate(results):
        assert got["mpu_is_sp"] and got["seq_parallel_size"] == 2 and got["stage"] == stage, rank
        assert got["loader_len"] == STEPS, rank
        assert got["shapes"] == [(MICRO, SEQ // 2)] * STEPS, rank
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), rank
        for name, want in ref["params"].items():
            torch.testing.assert_close(got["params"][name], want, rtol=1e-4, atol=1e-5, msg=f"rank {rank} {name}")


# ---------------------------------------------------------------------- the HF Trainer route
class _Samples(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.samples = _batches()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return self.samples[i]


def _train_trainer(out_dir: str, stage: int) -> dict:
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig
    from transformers import Trainer, TrainingArguments

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length=SEQ, sp_attn_implementation="sdpa")
    args = TrainingArguments(
        output_dir=out_dir,
        use_cpu=True,
        deepspeed={**_ds_config(stage), "gradient_clipping": "auto", "train_batch_size": "auto"},
        parallelism_config=ParallelismConfig(sp_size=2, sp_backend="deepspeed", sp_handler=handler),
        per_device_train_batch_size=MICRO,
        max_steps=STEPS,
        optim="sgd",
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    trainer = Trainer(model=tiny_llama("sdpa"), args=args, train_dataset=_Samples())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    engine = trainer.model_wrapped
    params = _full_params(engine)
    return {
        "loss": losses,
        "sp": engine.sequence_parallel_size,
        "stage": engine.zero_optimization_stage(),
        "params": params,
    }


@pytest.mark.parametrize("stage", [2, 3])
def test_hf_trainer_sp2_matches_whole_sequence(tmp_path, stage: int) -> None:
    """The HF Trainer with ``TrainingArguments(parallelism_config=...)``: the same two SGD steps, the Trainer's own
    SP loss (token-weighted over the SP group), the same parameters as one process on the whole sequences."""
    results = run_distributed(_train_trainer, 2, str(tmp_path), stage, timeout=TIMEOUT, env=QUIET_ENV)
    ref = _reference()
    for rank, got in enumerate(results):
        assert got["sp"] == 2 and got["stage"] == stage and got["loss"] == pytest.approx(ref["loss"], rel=1e-4), rank
        for name, want in ref["params"].items():
            torch.testing.assert_close(got["params"][name], want, rtol=1e-4, atol=1e-5, msg=f"rank {rank} {name}")
