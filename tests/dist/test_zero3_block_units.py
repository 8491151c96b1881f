"""ZeRO-3 repeated blocks as fetch units (``lean_block_fetch_units``) at world sizes 1, 2 and 4: the blocks of a
``ModuleList`` become units with no hooks inside, and the weights after training match the single-process
reference with the switch on and off (tied embeddings, a block called twice, a frozen parameter, accumulation,
clipping).

One spawn per world size runs both settings (process start-up dominates on a small CPU machine).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests._harness import run_distributed
from tests.reference.models import micro_batch
from tests.reference.zero_oracle import engine_micro_index, reference_train

GAS = 2
STEPS = 3
LR = 1e-2
VOCAB, HIDDEN = 37, 23


class Block(nn.Module):
    """Norm -> two linears, residual: the composite module the rule selects."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 2 * HIDDEN + 1)
        self.fc2 = nn.Linear(2 * HIDDEN + 1, HIDDEN)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.tanh(self.fc1(self.norm(h))))


class BlockNet(nn.Module):
    """Tied embedding / head around three blocks; the middle block runs twice, the last block's norm is frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.blocks[2].norm.requires_grad_(False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for i in (0, 1, 1, 2):
            h = self.blocks[i](h)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _make() -> BlockNet:
    torch.manual_seed(0)
    return BlockNet()


def _config(block_units: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 500,
            "stage3_param_persistence_threshold": 0,
            "lean_block_fetch_units": block_units,
        },
    }


def reference_weights(world: int) -> dict[str, torch.Tensor]:
    """The single-process reference's weights after the same training (fp32 copies)."""
    model = _make()
    reference_train(model, STEPS, world, GAS, lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.01), clip=1.0)
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _run_both(world: int) -> dict:
    import deepspeed
    from deepspeed import comm as dist

    out = {}
    for block_units in (True, False):
        model = _make()
        engine, *_ = deepspeed.initialize(model=model, config=_config(block_units))
        manager = engine.zero3_manager
        for step in range(STEPS):
            for m in range(GAS):
                engine.backward(engine(*micro_batch(step, engine_micro_index(m, dist.get_rank(), world))))
                engine.step()
        obj = [engine._zero3_consolidated_16bit_state_dict()]
        dist.broadcast_object_list(obj, src=0)
        out[block_units] = {
            "units": sorted(u.name for u in manager.units.values() if u.states()),
            "hooked_inside": any(bool(mod._forward_pre_hooks) for mod in engine.module.blocks[0].children()),
            "weights": {k: v.float().clone() for k, v in obj[0].items()},
        }
        engine.destroy()
    return out


@pytest.mark.parametrize("world", [1, 2, 4])
def test_blocks_change_units_not_numbers(world: int) -> None:
    results = run_distributed(_run_both, world, world)
    ref = reference_weights(world)
    init = _make().state_dict()
    assert any(not torch.allclose(init[k], v) for k, v in ref.items()), "the reference did not train"
    for rank_result in results:
        on, off = rank_result[True], rank_result[False]
        assert {"blocks.0", "blocks.1", "blocks.2"} <= set(on["units"]) and "blocks.0.fc1" not in on["units"]
        assert not on["hooked_inside"], "modules inside a block must not be hooked"
        assert "blocks.0.fc1" in off["units"] and "blocks.0" not in off["units"] and off["hooked_inside"]
        for case, got in (("on", on["weights"]), ("off", off["weights"])):
            for k, v in ref.items():  # the frozen norm's bias stays zero: compared absolutely
                torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k, c=case: f"{c}/{k}: {m}")


def _prefetched_next_block(world: int) -> dict:
    """With a prefetch window far smaller than a block, is the next block on its way while one runs?"""
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed._core.params.param import ShardedState

    cfg = _config(True)
    cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = 10  # a block holds ~2.4k elements
    cfg["gradient_accumulation_steps"] = 1
    engine, *_ = deepspeed.initialize(model=_make(), config=cfg)
    manager = engine.zero3_manager
    blocks = engine.module.blocks
    seen: list[bool] = []

    def probe(module, args):  # runs after the manager's own pre-forward hook
        nxt = manager._unit_by_module[id(blocks[2])]
        seen.append(any(s.state is not ShardedState.SHARDED for s in nxt.states()))

    handle = blocks[1].register_forward_pre_hook(probe)
    for step in range(2):  # the first step records the fetch order, the second replays it
        seen.clear()
        engine.backward(engine(*micro_batch(step, engine_micro_index(0, dist.get_rank(), world))))
        engine.step()
    handle.remove()
    engine.destroy()
    return {"next_block_in_flight": seen[:2]}  # blocks[1] runs twice in forward


@pytest.mark.parametrize("world", [1, 2])
def test_next_block_is_prefetched_whole_at_several_ranks(world: int) -> None:
    for rank in run_distributed(_prefetched_next_block, world, world):
        # At one rank there is nothing to overlap: the window alone decides, and it admits nothing.
        assert rank["next_block_in_flight"][-1] is (world > 1), rank
