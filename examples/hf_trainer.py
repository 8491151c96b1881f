"""Train a tiny GPT-2 with the Hugging Face ``Trainer`` on top of DeepSpeed (upstream or deepspeed-lean).

    deepspeed --num_gpus 2 examples/hf_trainer.py --deepspeed examples/ds_config_zero2_auto.json
    deepspeed --num_gpus 2 examples/hf_trainer.py --deepspeed examples/ds_config_zero3_auto.json \
        --save_strategy steps --save_steps 10 --output_dir /tmp/run1
    deepspeed --num_gpus 2 examples/hf_trainer.py --deepspeed examples/ds_config_zero3_auto.json \
        --output_dir /tmp/run2 --resume_from_checkpoint /tmp/run1/checkpoint-10

Everything HF-specific is stock ``transformers``: the script only builds a model from a config (nothing is
downloaded) and a small synthetic data set, then hands both to ``Trainer``. Every ``TrainingArguments`` flag
works; the defaults (``EXAMPLE_DEFAULTS``) suit the tiny model on CPU: 30 steps, lr 1e-2, no checkpoints, output
under the system temp directory. On a machine without GPUs the launcher starts CPU processes over gloo and the
script defaults to ``--use_cpu`` (accelerate needs it to run several CPU processes).

Rank 0 prints one ``LEAN_SUMMARY {json}`` line at the end (logged losses, global step, the step training started
from, the DeepSpeed config the engine received) and, with ``--summary_file``, writes the same JSON there; the
integration tests read it. The exit status is non-zero if the loss did not decrease.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    HfArgumentParser,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from deepspeed.accelerator import get_accelerator


@dataclass
class ScriptArguments:
    """Knobs of this script (the model and the data); training knobs are ``TrainingArguments``."""

    vocab_size: int = field(default=100, metadata={"help": "GPT-2 vocabulary size"})
    n_layer: int = field(default=2, metadata={"help": "number of transformer blocks"})
    n_embd: int = field(default=32, metadata={"help": "hidden size"})
    n_head: int = field(default=2, metadata={"help": "attention heads"})
    seq_len: int = field(default=16, metadata={"help": "tokens per sample"})
    num_samples: int = field(default=512, metadata={"help": "samples in the synthetic data set"})
    summary_file: str = field(default="", metadata={"help": "rank 0 writes the run summary (JSON) here"})


class CountingDataset(torch.utils.data.Dataset):
    """A learnable toy language: each sample counts up modulo the vocabulary from a seeded random start."""

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int) -> None:
        gen = torch.Generator().manual_seed(1234)
        starts = torch.randint(0, vocab_size, (num_samples, 1), generator=gen)
        self.tokens = (starts + torch.arange(seq_len)) % vocab_size

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> dict:
        ids = self.tokens[index]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


class LossRecorder(TrainerCallback):
    """Keeps the training losses the Trainer logs, with the step they were logged at."""

    def __init__(self) -> None:
        self.losses: list[tuple[int, float]] = []
        self.start_step: int | None = None

    def on_step_begin(self, args, state, control, **kwargs):  # HF callback signature
        """Note the step training really starts from (after a resume it is the checkpoint's step)."""
        if self.start_step is None:
            self.start_step = state.global_step
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):  # HF callback signature
        """Record ``loss`` entries (evaluation and summary logs carry other keys)."""
        if logs and "loss" in logs:
            self.losses.append((state.global_step, float(logs["loss"])))
        return control


# Defaults sized for the tiny model on CPU; any of them can be overridden on the command line.
EXAMPLE_DEFAULTS = {
    "output_dir": os.path.join(tempfile.gettempdir(), "deepspeed_lean_hf_trainer"),
    "max_steps": 30,
    "per_device_train_batch_size": 8,
    "learning_rate": 1e-2,
    "warmup_steps": 2,
    "logging_steps": 1,
    "save_strategy": "no",
    "report_to": "none",
    "disable_tqdm": True,
}


def build_model(script: ScriptArguments) -> torch.nn.Module:
    """A randomly initialised GPT-2 of the requested (tiny) size; nothing is downloaded.

    ``from_config`` (rather than calling the class) is what lets transformers build the model inside
    ``deepspeed.zero.Init`` under ZeRO-3, so each rank only ever holds its shard of the weights.
    """
    config = GPT2Config(
        vocab_size=script.vocab_size,
        n_positions=max(64, script.seq_len),
        n_embd=script.n_embd,
        n_layer=script.n_layer,
        n_head=script.n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=script.vocab_size - 1,  # GPT-2's defaults (50256) lie outside a tiny vocabulary
        eos_token_id=script.vocab_size - 1,
    )
    return AutoModelForCausalLM.from_config(config)


def main(argv: list[str] | None = None) -> dict:
    """Parse the arguments, train, and return (and on rank 0 print) the run summary."""
    parser = HfArgumentParser((ScriptArguments, TrainingArguments))
    # accelerate only starts a multi-process CPU run (gloo) when asked to use the CPU; a GPU box ignores this.
    parser.set_defaults(**EXAMPLE_DEFAULTS, use_cpu=get_accelerator().device_name() == "cpu")
    script, training_args = parser.parse_args_into_dataclasses(args=argv)
    # TrainingArguments must exist before the model when ZeRO-3 is used: it registers the DeepSpeed config
    # globally, which makes ``from_pretrained``/model construction go through ``deepspeed.zero.Init``.
    torch.manual_seed(training_args.seed)
    model = build_model(script)
    zero_init = all(hasattr(p, "ds_id") for p in model.parameters())  # partitioned at construction (ZeRO-3)
    dataset = CountingDataset(script.num_samples, script.seq_len, script.vocab_size)
    recorder = LossRecorder()
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset, callbacks=[recorder])
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    engine = trainer.model_wrapped
    summary = {
        "global_step": trainer.state.global_step,
        "start_step": recorder.start_step,
        "losses": recorder.losses,
        "train_loss": result.training_loss,
        "engine": type(engine).__module__ + "." + type(engine).__name__,
        "engine_global_steps": getattr(engine, "global_steps", None),
        "zero_stage": engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None,
        "world_size": training_args.world_size,
        "zero_init": zero_init,
        "ds_config": getattr(engine, "config", None),  # the config the engine got, "auto" values filled in
    }
    if training_args.process_index == 0:
        print("LEAN_SUMMARY " + json.dumps(summary, default=str), flush=True)
        if script.summary_file:
            with open(script.summary_file, "w") as fd:
                json.dump(summary, fd, default=str)
    return summary


if __name__ == "__main__":
    run = main(sys.argv[1:])
    losses = [loss for _, loss in run["losses"]]
    if len(losses) >= 2 and not losses[-1] < losses[0]:
        raise SystemExit(f"loss did not decrease: first {losses[0]:.4f} last {losses[-1]:.4f}")
