"""A config key with an effect needs one plan field that names it, and no conversion code ([Note: plan keys]).

Adding a key touches at most three places: its pydantic field (with the docstring the docs are generated from), its
rule in the surface table, and, when it has an effect, one plan field declared with ``key("...")``. These tests hold
the plan side of that: every plan field names keys the schema has and the surface table implements, the conversion
fills a keyed field from its metadata alone, and setting any keyed config key changes the plan field it names.
"""

from __future__ import annotations

import ast
import dataclasses
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import pytest

from deepspeed._core.config import convert
from deepspeed._core.config.base import DeepSpeedConfigModel, model_keys
from deepspeed._core.config.convert import fill, plan_keys
from deepspeed._core.config.plan import KEY, NESTED, derived, key, nested
from deepspeed._core.config.schema import RootConfig
from deepspeed._core.config.surface import SURFACE, Status
from deepspeed.runtime.config import DeepSpeedConfig

SCHEMA_KEYS = {name for name, _ in model_keys(RootConfig)}
KEYED = [entry for entry in plan_keys() if not entry.derived]


def test_every_plan_field_says_where_it_comes_from() -> None:
    unnamed = [entry.plan_path for entry in plan_keys() if not entry.config_keys]
    assert not unnamed, f"plan fields without key(), nested() or derived() metadata: {unnamed}"


@pytest.mark.parametrize("entry", plan_keys(), ids=lambda e: e.plan_path)
def test_plan_field_names_schema_keys_the_surface_implements(entry: convert.PlanKey) -> None:
    for name in entry.config_keys:
        assert name in SCHEMA_KEYS, f"plan field {entry.plan_path} names {name!r}, which the schema lacks"
        if not entry.derived:
            assert SURFACE[name].status is Status.IMPLEMENTED, f"{name} feeds {entry.plan_path} but is not implemented"


def test_every_key_field_is_filled_somewhere() -> None:
    # A key() field of a policy shared by several blocks must apply to at least one of them.
    listed = {entry.plan_path.rsplit(".", 1)[-1] for entry in KEYED}
    policies = {meta[NESTED][1] for entry in _all_fields() if NESTED in (meta := entry.metadata)}
    for policy in policies:
        for item in dataclasses.fields(policy):
            if KEY in item.metadata:
                assert item.name in listed, f"{policy.__name__}.{item.name} names a key no block models"


def _all_fields() -> list[dataclasses.Field]:
    from deepspeed._core.config.plan import RunPlan

    out, todo = [], [RunPlan]
    while todo:
        for item in dataclasses.fields(todo.pop()):
            out.append(item)
            if NESTED in item.metadata:
                todo.append(item.metadata[NESTED][1])
    return out


def test_conversion_has_no_per_key_code() -> None:
    # convert.py reads a copied key only through fill(); attribute reads there are of derived keys only.
    tree = ast.parse(Path(convert.__file__).read_text())
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    derived_names = {k.rsplit(".", 1)[-1] for e in plan_keys() if e.derived for k in e.config_keys}
    copied = {entry.config_keys[0].rsplit(".", 1)[-1] for entry in KEYED} - derived_names
    assert not read & copied, f"convert.py reads copied keys by hand: {sorted(read & copied)}"


# --------------------------------------------------------------------------------------------------------------
# fill() on a block and a policy of its own: what a new key needs is the field declaration and nothing else.


class _Inner(DeepSpeedConfigModel):
    config_block: ClassVar[str] = "probe.inner"
    depth: int = 4
    """Probe field."""


class _Probe(DeepSpeedConfigModel):
    config_block: ClassVar[str] = "probe"
    size: int = 10
    """Probe field."""
    mode: str = "a"
    """Probe field."""
    inner: _Inner | None = None
    """Probe block."""


@dataclasses.dataclass(frozen=True)
class _InnerPolicy:
    depth: int = key("depth", 4)


@dataclasses.dataclass(frozen=True)
class _ProbePolicy:
    size: int = key("size", 10)
    upper: str = key("mode", "A", str.upper)
    inner: _InnerPolicy = nested("inner", _InnerPolicy)
    both: int = derived("size", "inner.depth", default=0)


def test_fill_copies_converts_nests_and_asks_for_derived_values() -> None:
    block = _Probe(size=3, mode="b", inner={"depth": 7})
    policy = fill(_ProbePolicy, block, both=21)
    assert policy == _ProbePolicy(size=3, upper="B", inner=_InnerPolicy(depth=7), both=21)
    assert fill(_ProbePolicy, _Probe(), both=0).inner == _InnerPolicy()  # absent sub-block: defaults
    with pytest.raises(TypeError, match="both"):
        fill(_ProbePolicy, block)


def test_plan_keys_walks_a_policy() -> None:
    found = {e.plan_path: e.config_keys for e in plan_keys(_ProbePolicy, _Probe, "", "probe.")}
    assert found == {
        "size": ("probe.size",),
        "upper": ("probe.mode",),
        "inner.depth": ("probe.inner.depth",),
        "both": ("probe.size", "probe.inner.depth"),
    }


# --------------------------------------------------------------------------------------------------------------
# Every keyed field: setting its key (to a value other than the default) changes the plan field it names.

BASE = {"train_micro_batch_size_per_gpu": 1}
# A zenflow block needs stage 1/2 with the optimizer offloaded; it is given (auto_ratio 0.5) in "before" too.
_ZENFLOW = {
    "zero_optimization.stage": 2,
    "zero_optimization.offload_optimizer.device": "cpu",
    "zero_optimization.zenflow.auto_ratio": 0.5,
    "zero_optimization.zenflow.select_strategy": "step",
    "zero_optimization.zenflow.select_interval": 6,
    "zero_optimization.zenflow.update_interval": 2,
}
_ZENFLOW_VALUES = {
    "topk_ratio": 0.3,
    "select_strategy": "epoch",
    "select_interval": 8,
    "update_interval": 3,
    "overlap_step": True,
    "auto_ratio": 0.9,
    "full_warm_up_rounds": 2,
    "steps_per_epoch": 10,
}
# Keys whose effect needs another key set, or whose automatic value is not valid: key -> (value, context).
OVERRIDES: dict[str, tuple[Any, dict[str, Any]]] = {
    "fp16.loss_scale": (128.0, {"fp16.enabled": True}),
    "fp16.initial_scale_power": (8, {"fp16.enabled": True}),
    "fp16.loss_scale_window": (10, {"fp16.enabled": True}),
    "fp16.hysteresis": (4, {"fp16.enabled": True}),
    "fp16.consecutive_hysteresis": (True, {"fp16.enabled": True}),
    "fp16.min_loss_scale": (4, {"fp16.enabled": True}),
    "gradient_allreduce_op": ("sum", {}),
    "checkpoint.load_universal": (True, {"zero_optimization.stage": 2}),
    "zero_optimization.stage": (2, {}),
    "zero_optimization.overlap_comm": (True, {}),
    "zero_optimization.allgather_bucket_size": (1000, {}),
    "zero_optimization.offload_param.device": ("cpu", {"zero_optimization.stage": 3}),
    "zero_optimization.offload_optimizer.device": ("cpu", {}),
    "zero_optimization.offload_optimizer.nvme_path": (tempfile.gettempdir(), {}),
    "zero_optimization.offload_param.nvme_path": (tempfile.gettempdir(), {}),
    "zero_optimization.leaf_module.classes": (["Block"], {}),
    "zero_optimization.leaf_module.names": (["fc1"], {}),
    "zero_optimization.leaf_module.name_suffixes": ([".fc1"], {}),
    "steps_per_print": (5, {}),
    "memory_timeline.path": ("elsewhere", {}),
    **{
        f"{block}.{k}": ("elsewhere", {})
        for block in ("tensorboard", "csv_monitor")
        for k in ("output_path", "job_name")
    },
    **{f"wandb.{k}": ("elsewhere", {}) for k in ("group", "team", "project")},
    **{f"comet.{k}": ("x", {}) for k in ("project", "workspace", "api_key", "experiment_name", "experiment_key")},
    "comet.online": (False, {}),
    "comet.mode": ("get", {}),
    "flops_profiler.output_file": ("flops.txt", {}),
    **{f"zero_optimization.zenflow.{k}": (v, _ZENFLOW) for k, v in _ZENFLOW_VALUES.items()},
}


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = dict(BASE)
    for name, value in flat.items():
        node = out
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _other_value(name: str) -> tuple[Any, dict[str, Any]]:
    if name in OVERRIDES:
        return OVERRIDES[name]
    default = dict(model_keys(RootConfig))[name]
    if isinstance(default, bool):
        return not default, {}
    if isinstance(default, (int, float)):
        return default // 2 if default > 2 else default + 1, {}
    raise AssertionError(f"no non-default value known for {name}; add it to OVERRIDES")


def _read(plan: Any, path: str) -> Any:
    for part in path.split("."):
        plan = getattr(plan, part) if plan is not None else None  # an absent optional block reads as None
    return plan


@pytest.mark.parametrize("entry", KEYED, ids=lambda e: e.config_keys[0])
def test_setting_the_key_changes_its_plan_field(entry: convert.PlanKey) -> None:
    (name,) = entry.config_keys
    value, context = _other_value(name)
    before = _read(DeepSpeedConfig(_nest(context)).plan, entry.plan_path)
    after = _read(DeepSpeedConfig(_nest({**context, name: value})).plan, entry.plan_path)
    assert after != before, f"{name}={value!r} leaves plan.{entry.plan_path} at {before!r}"
