"""ZeRO-3 leaf modules from the config at world size 2: ``zero_optimization.leaf_module`` and
``stage3_module_granularity_threshold`` change the fetch units, not the numbers (parity with the single-process
reference), and a class name that matches nothing is logged and ignored.

One spawn runs every case (process start-up dominates on a small CPU machine).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tests._harness import run_distributed
from tests.reference.models import micro_batch
from tests.reference.zero_oracle import engine_micro_index, reference_train

WORLD = 2
GAS = 2
STEPS = 4
LR = 1e-2
THRESHOLD = 100  # scales: 92 / 6 = 15.3 < 100 <= ffn: 2232 / 3 = 744, root: 4072 / 13 = 313


class FFN(nn.Module):
    """Two layers fetched as one unit when configured as a leaf."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 2 * hidden + 1)
        self.fc2 = nn.Linear(2 * hidden + 1, hidden)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(h)))


class Scale(nn.Module):
    """A tiny module (one 23-element vector): the fine-grained part the threshold groups."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(hidden))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.weight


class Scales(nn.Module):
    """Four scales applied in turn: 92 elements over 6 modules (itself, the list, four scales) = 15.3 each."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.items = nn.ModuleList(Scale(hidden) for _ in range(4))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for scale in self.items:
            h = scale(h)
        return h


class LeafNet(nn.Module):
    """Embedding -> FFN (residual) -> four scales -> norm -> head; returns the mean cross-entropy."""

    def __init__(self, vocab: int = 37, hidden: int = 23) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.ffn = FFN(hidden)
        self.scales = Scales(hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.ffn(h)
        h = self.scales(h)
        logits = self.head(self.norm(h))
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _make() -> LeafNet:
    torch.manual_seed(0)
    return LeafNet()


def _config(**zero: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01, "torch_adam": True}},
        # No prefetch and no reuse: what is gathered at a boundary is what the current units need.
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 500,
            "stage3_param_persistence_threshold": 0,
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0,
            **zero,
        },
    }


def _weights(engine: object) -> dict[str, torch.Tensor]:
    from deepspeed import comm as dist

    obj = [engine._zero3_consolidated_16bit_state_dict()]  # type: ignore[attr-defined]
    dist.broadcast_object_list(obj, src=0)
    return {k: v.float().clone() for k, v in obj[0].items()}


def _run(cfg: dict, zero_init: bool) -> dict:
    import deepspeed
    from deepspeed import comm as dist
    from deepspeed._core.params.manager import is_z3_leaf

    if zero_init:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = _make()
    else:
        model = _make()
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    manager = engine.zero3_manager
    manager.boundary_samples = []
    for step in range(STEPS):
        for m in range(GAS):
            engine.backward(engine(*micro_batch(step, engine_micro_index(m, dist.get_rank(), WORLD))))
            engine.step()
    out = {
        "units": sorted(u.name for u in manager.units.values()),
        "leaves": sorted(name for name, mod in engine.module.named_modules() if is_z3_leaf(mod)),
        "hooked_below_leaf": any(
            bool(mod._forward_pre_hooks) for mod in engine.module.ffn.modules() if mod is not engine.module.ffn
        ),
        "alive_at_ffn": max(
            s.params_alive for s in manager.boundary_samples if s.event == "pre_forward" and s.module.startswith("ffn")
        ),
        "weights": _weights(engine),
    }
    engine.destroy()
    for mod in model.modules():  # the marks live on the model; a later case starts clean
        mod.__dict__.pop("_z3_leaf", None)
    return out


def _all_cases() -> dict:
    from deepspeed.utils.logging import logger

    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        results = {
            "classes": _run(_config(leaf_module={"classes": ["FFN"]}), zero_init=False),
            "threshold": _run(_config(stage3_module_granularity_threshold=THRESHOLD), zero_init=True),
            "unknown": _run(_config(leaf_module={"classes": ["NoSuchBlock"]}), zero_init=False),
        }
    finally:
        logger.removeHandler(handler)
    results["warnings"] = [r.getMessage() for r in records]
    return results


def _reference() -> dict[str, torch.Tensor]:
    model = _make()
    reference_train(model, STEPS, WORLD, GAS, lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.01), clip=1.0)
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


def _assert_parity(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], case: str) -> None:
    # Same tolerance as the ZeRO-3 engine parity test (tests/dist/test_engine_parity.py, fp32).
    for k, v in ref.items():
        rel = float((got[k] - v).norm() / v.norm())
        assert rel < 1e-6, f"{case}/{k}: relative error {rel:.3g} vs the fp32 reference"
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{case}/{k}: {m}")


def test_leaf_config_changes_units_not_numbers() -> None:
    results = run_distributed(_all_cases, WORLD)
    ref = _reference()
    init = _make().state_dict()
    assert any(not torch.allclose(init[k], v) for k, v in ref.items()), "the reference did not train"
    for rank_result in results:
        classes, threshold, unknown = rank_result["classes"], rank_result["threshold"], rank_result["unknown"]
        # classes: ["FFN"] -> ffn and its two layers are one unit, nothing hooked beneath it.
        assert classes["leaves"] == ["ffn"]
        assert "ffn" in classes["units"] and "ffn.fc1" not in classes["units"]
        assert not classes["hooked_below_leaf"]
        assert classes["alive_at_ffn"] == 4  # fc1 + fc2, weights and biases, gathered together
        # threshold: only the fine-grained block of scales becomes a leaf (zero.Init-partitioned params
        # are measured at full size).
        assert threshold["leaves"] == ["scales"]
        assert "scales" in threshold["units"] and "scales.items.0" not in threshold["units"]
        assert "ffn.fc1" in threshold["units"]
        # unknown class: logged, ignored; the default fine-grained units stay.
        assert unknown["leaves"] == [] and "ffn.fc1" in unknown["units"]
        assert unknown["alive_at_ffn"] == 2  # one layer at a time
        for case in ("classes", "threshold", "unknown"):
            _assert_parity(rank_result[case]["weights"], ref, case)
    warnings = results[0]["warnings"]
    assert any("zero_optimization.leaf_module.classes: 'NoSuchBlock' matches no module" in w for w in warnings), (
        warnings
    )
    assert not any("NoSuchBlock" in w for w in results[1]["warnings"]), "only rank 0 logs"
