"""ZeRO-3 leaf selection from the config (``deepspeed/_core/params/leaf_policy.py``): matching rules over several
module trees, the granularity threshold, unmatched entries, and the application point at world size 1."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from deepspeed._core.comm.groups import ShardGroup
from deepspeed._core.config.plan import DEFAULT_LEAF_MODULE_CLASSES, LeafModulePolicy, LeanPolicy, Stage3Policy
from deepspeed._core.params.leaf_policy import (
    GRANULARITY_KEY,
    module_granularity,
    report_leaf_selection,
    select_leaf_modules,
    subtree_numel,
)
from deepspeed._core.params.manager import ParamStorage, ZeroParamManager, is_z3_leaf
from deepspeed._core.params.param import FullStorage, zero_state
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from deepspeed.utils.logging import logger
from deepspeed.utils.z3_leaf_module import set_z3_leaf_modules

WORLD1 = ShardGroup(None, 0, 1)
NO_DEFAULTS = LeafModulePolicy(classes=())


class Mixer(nn.Module):
    """Three tiny layers: 3 * 72 = 216 elements over 5 modules (itself, the list, 3 layers): granularity 43.2."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList()  # no parameters of its own; counted as a module
        for _ in range(3):
            self.layers.append(nn.Linear(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class SubMixer(Mixer):
    """A subclass: a string entry ``Mixer`` must not match it."""


class Net(nn.Module):
    """``down`` (192) -> ``mix`` -> ``up`` (207) -> ``head`` (216): 831 elements over 9 modules (92.3)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Linear(23, 8)
        self.mix = Mixer()
        self.up = nn.Linear(8, 23)
        self.head = nn.Linear(23, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.up(self.mix(self.down(x)))))


def _names(selection: object) -> list[str]:
    return [name for name, _ in selection.modules]  # type: ignore[attr-defined]


def _tree() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Net(), nn.Sequential(Mixer(), SubMixer()), nn.Linear(4, 4))


def test_granularity_is_elements_per_module_of_the_subtree() -> None:
    net = Net()
    assert subtree_numel(net.mix) == 216 and module_granularity(net.mix) == pytest.approx(216 / 5)
    assert module_granularity(net) == pytest.approx(831 / 9)
    assert module_granularity(net.down) is None  # childless: already one unit
    assert module_granularity(nn.Sequential(nn.ReLU(), nn.ReLU())) is None  # nothing to fetch


def test_classes_match_bare_and_qualified_names_of_the_exact_class() -> None:
    model = _tree()
    bare = select_leaf_modules(model, LeafModulePolicy(classes=("Mixer",)))
    assert _names(bare) == ["0.mix", "1.0"]  # SubMixer ("1.1") is a subclass: not matched by a string
    qualified = select_leaf_modules(model, LeafModulePolicy(classes=(f"{__name__}.SubMixer",)))
    assert _names(qualified) == ["1.1"] and not qualified.unmatched
    # The API matches subclasses for class objects, and fully qualified strings as the config does.
    assert len(set_z3_leaf_modules(copy.deepcopy(model), [Mixer])) == 3
    assert len(set_z3_leaf_modules(copy.deepcopy(model), [f"{__name__}.Mixer"])) == 2


def test_names_suffixes_and_nesting() -> None:
    model = _tree()
    by_name = select_leaf_modules(model, LeafModulePolicy(classes=(), names=("0.mix.layers", "0.mix", "1")))
    # "0.mix.layers" lies inside the selected "0.mix": it needs no mark of its own, yet it is not "unmatched".
    assert _names(by_name) == ["0.mix", "1"] and not by_name.unmatched
    by_suffix = select_leaf_modules(model, LeafModulePolicy(classes=(), name_suffixes=("down", "up")))
    assert _names(by_suffix) == ["0.down", "0.up"]
    root = select_leaf_modules(model, LeafModulePolicy(classes=(), names=("",)))
    assert _names(root) == [""]  # the root's name is ""; then nothing else needs marking


def test_containers_without_forward_give_way_to_their_enclosing_module() -> None:
    model = _tree()
    # "layers" are ModuleLists: never called, so as leaves they would never be fetched.
    selection = select_leaf_modules(model, LeafModulePolicy(classes=(), name_suffixes=("layers",)))
    assert _names(selection) == ["0.mix", "1.0", "1.1"]
    assert selection.substituted == (("0.mix.layers", "0.mix"), ("1.0.layers", "1.0"), ("1.1.layers", "1.1"))
    # The threshold passes over containers and considers their children.
    # The list: 432 / 11 = 39.3; the root: (272 + 432) / 13 = 54.2; the mixers: 43.2.
    wrapper = nn.Sequential(nn.Linear(16, 16), nn.ModuleList([Mixer(), Mixer()]))
    assert _names(select_leaf_modules(wrapper, NO_DEFAULTS, 40)) == []
    assert _names(select_leaf_modules(wrapper, NO_DEFAULTS, 44)) == ["1.0", "1.1"]


def test_already_marked_leaves_are_skipped_with_their_subtrees() -> None:
    model = _tree()
    set_z3_leaf_modules(model, ["Net"])
    selection = select_leaf_modules(model, LeafModulePolicy(classes=("Mixer",)), already_leaf=is_z3_leaf)
    assert _names(selection) == ["1.0"]


def test_threshold_marks_the_outermost_fine_grained_modules() -> None:
    model = _tree()
    # Root: 831 + 2*216 + 20 = 1283 elements over 1 + 9 + 11 + 1 = 22 modules (58.3). "1": 432 / 11 (39.3).
    # Mixers: 43.2. Net: 92.3. Childless modules are never selected; "below" is strict.
    assert _names(select_leaf_modules(model, NO_DEFAULTS, 40)) == ["1"]
    assert _names(select_leaf_modules(model, NO_DEFAULTS, 44)) == ["0.mix", "1"]
    assert _names(select_leaf_modules(model, NO_DEFAULTS, 59)) == [""]  # the whole model is fine-grained
    assert _names(select_leaf_modules(model, NO_DEFAULTS, 39)) == []
    assert _names(select_leaf_modules(model, NO_DEFAULTS, 0)) == []


def test_threshold_counts_tied_parameters_once() -> None:
    block = nn.Sequential(nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False))
    block[1].weight = block[0].weight
    assert subtree_numel(block) == 36 and module_granularity(block) == pytest.approx(12.0)


def test_threshold_reads_full_sizes_of_partitioned_parameters() -> None:
    model = Net()
    before = {name: module_granularity(m) for name, m in model.named_modules()}
    manager = ZeroParamManager(
        model, WORLD1, Stage3Policy(param_persistence_threshold=0, leaf_module=NO_DEFAULTS), LeanPolicy()
    )
    assert model.mix.layers[0].weight.numel() == 0  # placeholders once partitioned
    assert {name: module_granularity(m) for name, m in model.named_modules()} == before
    manager.destroy()


def test_unmatched_entries_are_reported_with_nearest_spellings() -> None:
    model = _tree()
    policy = LeafModulePolicy(
        classes=(*DEFAULT_LEAF_MODULE_CLASSES, "Mixr"), names=("0.mixx",), name_suffixes=("layer",)
    )
    selection = select_leaf_modules(model, policy)
    assert _names(selection) == []
    misses = {e.key: e for e in selection.unmatched}
    assert set(misses) == {
        "zero_optimization.leaf_module.classes",
        "zero_optimization.leaf_module.names",
        "zero_optimization.leaf_module.name_suffixes",
    }  # the default classes are not reported
    assert misses["zero_optimization.leaf_module.classes"].value == "Mixr"
    assert misses["zero_optimization.leaf_module.classes"].nearest[0] == "Mixer"
    assert misses["zero_optimization.leaf_module.names"].nearest[0] == "0.mix"
    assert "layers" in misses["zero_optimization.leaf_module.name_suffixes"].nearest


@pytest.fixture
def ds_logs() -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler(level=logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


def test_reports_warn_for_misses_and_for_a_threshold_that_selects_nothing(ds_logs: list) -> None:
    model = _tree()
    selection = select_leaf_modules(model, LeafModulePolicy(classes=("Nope",)), 10)
    assert selection.finest == ("1", pytest.approx(432 / 11))
    report_leaf_selection(model, selection, 10)
    warnings = [r.getMessage() for r in ds_logs if r.levelno == logging.WARNING]
    assert any("zero_optimization.leaf_module.classes: 'Nope' matches no module of Sequential" in w for w in warnings)
    assert any(GRANULARITY_KEY in w and "'1'" in w for w in warnings)
    assert select_leaf_modules(model, NO_DEFAULTS, 40).finest is None


def test_negative_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="stage3_module_granularity_threshold=-1"):
        select_leaf_modules(Net(), NO_DEFAULTS, -1)


def test_config_reaches_the_plan_with_upstream_defaults() -> None:
    default = DeepSpeedConfig({"train_batch_size": 8, "zero_optimization": {"stage": 3}}).plan.zero.stage3
    assert default.leaf_module.classes == DEFAULT_LEAF_MODULE_CLASSES and default.module_granularity_threshold == 0
    cfg = DeepSpeedConfig(
        {
            "train_batch_size": 8,
            "zero_optimization": {
                "stage": 3,
                "stage3_module_granularity_threshold": 7,
                "leaf_module": {"classes": ["Mixer"], "names": ["a.b"], "name_suffixes": ["experts"]},
            },
        }
    )
    stage3 = cfg.plan.zero.stage3
    assert stage3.leaf_module == LeafModulePolicy(classes=("Mixer",), names=("a.b",), name_suffixes=("experts",))
    assert stage3.module_granularity_threshold == 7


def _loss_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    loss = model(x).square().mean()
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def _assert_reference_step(manager: ZeroParamManager, model: nn.Module, reference: nn.Module, x: torch.Tensor) -> None:
    """One forward and backward of ``model`` under ``manager`` (boundary samples on): the loss and every
    parameter's gradient (summed over its arrivals) equal the unpartitioned ``reference``'s."""
    grads: dict[int, torch.Tensor] = {}

    def take(param: nn.Parameter, state: object, grad: torch.Tensor) -> None:
        grads[param.ds_id] = grads.get(param.ds_id, 0) + grad.clone()
        param.grad = None

    manager.on_grad_ready(take)
    manager.boundary_samples = []
    ref_loss, ref_grads = _loss_and_grads(reference, x)
    loss = model(x).square().mean()
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss, abs=1e-6)
    for param, want in zip(model.parameters(), ref_grads, strict=True):
        torch.testing.assert_close(grads[param.ds_id], want)


def test_manager_applies_the_policy_before_building_units() -> None:
    torch.manual_seed(1)
    model = Net()
    reference = copy.deepcopy(model)
    manager = ZeroParamManager(
        model,
        WORLD1,
        Stage3Policy(param_persistence_threshold=0, leaf_module=LeafModulePolicy(classes=("Mixer",))),
        LeanPolicy(),
    )
    assert manager.config_leaves == [model.mix] and is_z3_leaf(model.mix)
    assert {u.name for u in manager.units.values()} == {"<root>", "down", "mix", "up", "head"}
    assert not model.mix.layers[0]._forward_pre_hooks, "modules inside a leaf must not be hooked"
    _assert_reference_step(manager, model, reference, torch.randn(5, 23))
    assert max(s.params_alive for s in manager.boundary_samples) == 6  # the mixer's six tensors at once
    manager.destroy()


def test_offload_facade_applies_the_threshold_and_the_config_block() -> None:
    model = Net()
    # mix: 43.2 < 50 <= Net: 92.3
    DeepSpeedZeRoOffload(model, param_persistence_threshold=0, zero_module_granularity_threshold=50).destroy()
    assert is_z3_leaf(model.mix) and not is_z3_leaf(model)
    other = Net()
    cfg = DeepSpeedConfig(
        {"train_batch_size": 8, "zero_optimization": {"stage": 3, "leaf_module": {"names": ["mix.layers"]}}}
    )
    DeepSpeedZeRoOffload(other, ds_config=cfg, param_persistence_threshold=0).destroy()
    assert is_z3_leaf(other.mix) and not is_z3_leaf(other.mix.layers)  # the container gives way to its owner


class Block(nn.Module):
    """A composite block (two linears): the unit the repeated-block rule is for."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Stack(nn.Module):
    """An embedding-like input layer, four repeated blocks, one odd block, a head: 6 + 4 * 144 + 144 + 18 elements."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(1, 3)
        self.proj = nn.Linear(3, 8, bias=False)
        self.blocks = nn.ModuleList([Block() for _ in range(4)] + [Mixer()])
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(self.inp(x))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _names(selection) -> list[str]:
    return [name for name, _ in selection.modules]


def test_repeated_blocks_are_the_children_of_a_list_of_like_composite_modules() -> None:
    model = Stack()
    selection = select_leaf_modules(model, NO_DEFAULTS, block_limit=10**9)
    # The lone Mixer is not repeated; plain linears (Mixer's own list) are units already.
    assert _names(selection) == [f"blocks.{i}" for i in range(4)] and selection.repeated_blocks == 4
    assert _names(select_leaf_modules(model, NO_DEFAULTS)) == []  # off without a limit
    assert _names(select_leaf_modules(model, NO_DEFAULTS, block_limit=143)) == []  # a block holds 144 elements
    assert _names(select_leaf_modules(model, NO_DEFAULTS, granularity_threshold=1, block_limit=10**9)) == []


def test_explicit_entries_win_over_repeated_blocks() -> None:
    model = Stack()
    inner = select_leaf_modules(model, LeafModulePolicy(classes=(), names=("blocks.1.fc1",)), block_limit=10**9)
    assert _names(inner) == ["blocks.0", "blocks.1.fc1", "blocks.2", "blocks.3"] and inner.repeated_blocks == 3
    outer = select_leaf_modules(model, LeafModulePolicy(classes=(), names=("blocks.4",)), block_limit=10**9)
    assert _names(outer) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "blocks.4"]
    assert outer.repeated_blocks == 4


@pytest.mark.parametrize("block_units", [True, False])
def test_manager_fetches_repeated_blocks_as_units_with_the_reference_gradients(block_units: bool) -> None:
    torch.manual_seed(2)
    model = Stack()
    reference = copy.deepcopy(model)
    manager = ZeroParamManager(
        model,
        WORLD1,
        Stage3Policy(param_persistence_threshold=0, leaf_module=NO_DEFAULTS),
        LeanPolicy(block_fetch_units=block_units),
    )
    blocks = {f"blocks.{i}" for i in range(4)}
    names = {u.name for u in manager.units.values() if u.states()}
    if block_units:
        assert blocks <= names and "blocks.0.fc1" not in names
        assert not model.blocks[0].fc1._forward_pre_hooks, "modules inside a block must not be hooked"
    else:
        assert not blocks & names and "blocks.0.fc1" in names
    _assert_reference_step(manager, model, reference, torch.randn(5, 1))
    # A block's four tensors are gathered together; per submodule, one linear's two at a time.
    assert max(s.params_alive for s in manager.boundary_samples) == (4 if block_units else 2)
    manager.destroy()


class Gate(nn.Module):
    """Owns a vector that the blocks' inner modules also read (registered as external there)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


class Borrow(nn.Module):
    """Scales by another module's parameter: a use that only an external registration makes visible."""

    def __init__(self, gate: Gate) -> None:
        super().__init__()
        self.gate = [gate]  # a plain list: not a child, the parameter stays the gate's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate[0].w


class BorrowBlock(Block):
    def __init__(self, gate: Gate) -> None:
        super().__init__()
        self.borrow = Borrow(gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.borrow(super().forward(x))


class BorrowStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gate = Gate()
        self.blocks = nn.ModuleList(BorrowBlock(gate) for _ in range(3))
        self.gate = gate  # runs after the blocks: its own unit is not gathered while they run

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.gate(x)


def test_externals_registered_inside_a_block_are_fetched_with_it() -> None:
    from deepspeed._core.params.manager import register_external

    torch.manual_seed(3)
    model = BorrowStack()
    reference = copy.deepcopy(model)
    for block in model.blocks:
        register_external(block.borrow, model.gate.w)
    manager = ZeroParamManager(  # separate gathered storage: a parameter not fetched holds no values
        model,
        WORLD1,
        Stage3Policy(param_persistence_threshold=0, leaf_module=NO_DEFAULTS),
        LeanPolicy(),
        storage=ParamStorage(single_rank=FullStorage.SEPARATE),
    )
    assert is_z3_leaf(model.blocks[0]) and not model.blocks[0].borrow._forward_pre_hooks
    gate_state = zero_state(model.gate.w)
    for block in model.blocks:  # part of each block's unit from the start, not only once a forward reads it
        assert any(s is gate_state for s in manager._unit_of(block).states())
    _assert_reference_step(manager, model, reference, torch.randn(5, 8))
    manager.destroy()
