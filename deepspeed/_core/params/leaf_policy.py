"""Which modules the config makes ZeRO-3 leaves (``zero_optimization.leaf_module``,
``stage3_module_granularity_threshold`` and ``lean_block_fetch_units``).

A leaf is fetched and released as one unit together with its whole subtree, and no hooks are installed below
it (see ``is_z3_leaf`` in ``manager.py``). This module only *selects*; the manager marks the selection before it
installs hooks or builds units. Nothing here touches a process group.

Rules:

- ``classes``: an entry matches a module whose exact class has that bare name (``MyBlock``) or that fully
  qualified name (``my_pkg.layers.MyBlock``, i.e. ``cls.__module__ + "." + cls.__qualname__``). Subclasses do
  not match a string entry (``set_z3_leaf_modules`` with a class object still matches subclasses).
- ``names``: an entry matches the module with exactly that qualified name as ``named_modules()`` spells it
  (``""`` is the root). A module reachable under several names matches any of them.
- ``name_suffixes``: an entry matches every module whose qualified name ends with it (plain string suffix).
- granularity: with a threshold ``T > 0``, a module with at least one child and at least one parameter
  element in its subtree is selected when ``elements(subtree) / modules(subtree) < T``, where ``modules``
  counts the module itself and all its descendants (upstream: ``parameter_count / (1 + descendant_count)``).
  Elements count each distinct parameter once, at its full (unpartitioned) size. Childless modules are never
  selected by the threshold: they already are one unit.
- Containers that define no ``forward`` (``ModuleList``, ``ModuleDict``) are never called, so hooks on them
  never run and, as leaves, their subtree would never be fetched. The threshold passes over them (their
  children are considered instead); an entry that names one selects its nearest enclosing module that does
  run a forward (for ``experts`` in an MoE block, the block: all experts are fetched together whichever the
  router picks, which is what the entry is for), and the substitution is reported.
- Walk order is pre-order from the root; the walk does not descend into a selected module or one already
  marked as a leaf (through ``set_z3_leaf_modules``), so nested modules are never selected: the outer leaf
  already fetches them.
- Repeated blocks (``lean_block_fetch_units``, on by default, and only while no threshold is set): every child
  of an ``nn.ModuleList`` that holds at least two children of one class is selected when that class runs a
  forward, the child has children of its own, and its subtree holds at most ``block_limit`` parameter elements
  (``stage3_max_live_parameters``: a block never gathers more than the live bound). These are the transformer
  blocks that FSDP2 recipes wrap one by one: one unit, one gather and one set of hooks per block instead of one
  per linear layer ([Note: zero3-blocks]). Explicit entries win where both apply: the walk stops at one above a
  block, and a block holding one inside is not selected.
- An entry matching no module is reported (the caller logs a warning with the nearest spellings) and
  otherwise ignored. Upstream's default ``classes`` name Hugging Face MoE blocks that most models do not
  contain, so upstream cannot treat a miss as an error either; misses of those default entries are not reported.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from deepspeed._core.config.plan import DEFAULT_LEAF_MODULE_CLASSES, LeafModulePolicy
from deepspeed._core.params.param import zero_state
from deepspeed._foundation.logging import log_dist

LEAF_MODULE_KEY = "zero_optimization.leaf_module"
GRANULARITY_KEY = "zero_optimization.stage3_module_granularity_threshold"
_NEAREST = 3


def class_spellings(cls: type) -> tuple[str, str]:
    """The two names a ``classes`` entry may use for ``cls``: bare and fully qualified."""
    return cls.__name__, f"{cls.__module__}.{cls.__qualname__}"


def class_entry_matches(entry: str, module: nn.Module) -> bool:
    """True when the ``classes`` entry ``entry`` names ``module``'s exact class."""
    return entry in class_spellings(type(module))


def subtree_numel(module: nn.Module) -> int:
    """Parameter elements in ``module``'s subtree, each parameter once, at full size even when partitioned."""
    total = 0
    for param in module.parameters():
        state = zero_state(param)
        total += state.numel if state is not None else param.numel()
    return total


def runs_forward(module: nn.Module) -> bool:
    """False for containers that define no ``forward`` (``ModuleList``, ``ModuleDict``): they are never called."""
    return type(module).forward is not nn.Module.forward


def module_granularity(module: nn.Module) -> float | None:
    """Parameter elements per module in ``module``'s subtree (``elements / (1 + descendants)``), or ``None``
    when the threshold never applies to ``module`` (no child, no forward, or no parameter element below it)."""
    if next(module.children(), None) is None or not runs_forward(module):
        return None
    numel = subtree_numel(module)
    return numel / sum(1 for _ in module.modules()) if numel else None


@dataclass(frozen=True)
class UnmatchedEntry:
    """A config entry that matched no module: ``key`` is the full config key, ``nearest`` similar spellings."""

    key: str
    value: str
    nearest: tuple[str, ...]

    def message(self, model: nn.Module) -> str:
        """The warning text."""
        hint = f"; nearest: {', '.join(self.nearest)}" if self.nearest else ""
        return f"{self.key}: {self.value!r} matches no module of {type(model).__name__}; ignored{hint}"


@dataclass(frozen=True)
class LeafSelection:
    """The outcome of :func:`select_leaf_modules`.

    Attributes:
        modules: ``(qualified name, module)`` pairs to mark, in pre-order; none is inside another selected or
            already-marked leaf, and none is already marked.
        unmatched: config entries (default classes excepted) that matched no module.
        finest: with a threshold that selected nothing, the ``(name, granularity)`` of the finest module it
            could have selected (``None`` otherwise, or when the model has no such module).
        substituted: ``(container, enclosing module)`` names where a matched container without ``forward``
            was replaced by its nearest enclosing module that runs one.
        repeated_blocks: how many of ``modules`` the repeated-block rule selected (and no explicit entry).
    """

    modules: tuple[tuple[str, nn.Module], ...]
    unmatched: tuple[UnmatchedEntry, ...]
    finest: tuple[str, float] | None = None
    substituted: tuple[tuple[str, str], ...] = ()
    repeated_blocks: int = 0


def _never(module: nn.Module) -> bool:
    return False


def _nearest(value: str, pool: Iterable[str]) -> tuple[str, ...]:
    pool = sorted(set(pool))
    close = difflib.get_close_matches(value, pool, n=_NEAREST, cutoff=0.5)
    return tuple(close) if close else tuple(pool[:_NEAREST])


def _explicit_matches(root: nn.Module, policy: LeafModulePolicy) -> tuple[set[int], list[UnmatchedEntry]]:
    """Ids of modules matched by ``classes`` / ``names`` / ``name_suffixes``, and the entries that hit nothing
    (containers not yet substituted)."""
    named = list(root.named_modules(remove_duplicate=False))
    hits: set[int] = set()
    unmatched: list[UnmatchedEntry] = []
    names = [name for name, _ in named if name]
    rules: list[tuple[str, tuple[str, ...], Callable[[str, str, nn.Module], bool], list[str]]] = [
        (
            "classes",
            policy.classes,
            lambda e, n, m: class_entry_matches(e, m),
            [s for _, m in named for s in class_spellings(type(m))],
        ),
        ("names", policy.names, lambda e, n, m: n == e, names),
        (
            "name_suffixes",
            policy.name_suffixes,
            lambda e, n, m: n.endswith(e),
            names + [n.rsplit(".", 1)[-1] for n in names],
        ),
    ]
    for key, entries, matches, pool in rules:
        for entry in entries:
            found = {id(m) for n, m in named if matches(entry, n, m)}
            hits |= found
            if not found and not (key == "classes" and entry in DEFAULT_LEAF_MODULE_CLASSES):
                unmatched.append(UnmatchedEntry(f"{LEAF_MODULE_KEY}.{key}", entry, _nearest(entry, pool)))
    return hits, unmatched


def _substitute_containers(root: nn.Module, hits: set[int]) -> tuple[set[int], list[tuple[str, str]]]:
    """Replace each matched container without ``forward`` by its nearest enclosing module that runs one."""
    parent: dict[int, nn.Module] = {}
    name_of: dict[int, str] = {}
    for name, module in root.named_modules():
        name_of[id(module)] = name
        for child in module.children():
            parent.setdefault(id(child), module)
    by_id = {id(m): m for m in root.modules()}
    result: set[int] = set()
    substituted: list[tuple[str, str]] = []
    for key in hits:
        module = by_id[key]
        while not runs_forward(module) and id(module) in parent:
            module = parent[id(module)]
        result.add(id(module))
        if id(module) != key:
            substituted.append((name_of[key], name_of[id(module)] or "<root>"))
    return result, sorted(substituted)


def repeated_blocks(root: nn.Module, block_limit: int) -> set[int]:
    """Ids of the repeated blocks of ``root``'s tree (the rule in this module's docstring)."""
    blocks: set[int] = set()
    for module in root.modules():
        if not isinstance(module, nn.ModuleList):
            continue
        by_class: dict[type, list[nn.Module]] = {}
        for child in module.children():
            by_class.setdefault(type(child), []).append(child)
        for children in by_class.values():
            if len(children) < 2 or not runs_forward(children[0]):
                continue
            for child in children:
                if next(child.children(), None) is not None and 0 < subtree_numel(child) <= block_limit:
                    blocks.add(id(child))
    return blocks


def select_leaf_modules(
    root: nn.Module,
    policy: LeafModulePolicy,
    granularity_threshold: int = 0,
    already_leaf: Callable[[nn.Module], bool] = _never,
    block_limit: int | None = None,
) -> LeafSelection:
    """Apply the rules in this module's docstring to ``root``'s tree; ``already_leaf`` says which modules are
    marked already (their subtrees are skipped); ``block_limit`` (``None``: off) selects repeated blocks of at
    most that many parameter elements."""
    if granularity_threshold < 0:
        raise ValueError(f"{GRANULARITY_KEY}={granularity_threshold} is not valid; valid: an integer >= 0 (0 = off)")
    hits, unmatched = _explicit_matches(root, policy)
    explicit, substituted = _substitute_containers(root, hits)
    blocks = repeated_blocks(root, block_limit) if block_limit is not None and granularity_threshold == 0 else set()
    if blocks and explicit:  # an explicit entry inside a block asks for a finer unit there: the block gives way
        by_id = {id(m): m for m in root.modules()}
        blocks = {key for key in blocks if not any(id(m) in explicit for m in by_id[key].modules())}
    selected: list[tuple[str, nn.Module]] = []
    finest: tuple[str, float] | None = None
    seen: set[int] = set()
    stack: list[tuple[str, nn.Module]] = [("", root)]
    while stack:
        name, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if already_leaf(module):
            continue
        chosen = id(module) in explicit or id(module) in blocks
        value = module_granularity(module) if not chosen and granularity_threshold > 0 else None
        if value is not None:
            chosen = value < granularity_threshold
            if finest is None or value < finest[1]:
                finest = (name or "<root>", value)
        if chosen:
            selected.append((name, module))
            continue
        children = [
            (f"{name}.{child_name}" if name else child_name, child) for child_name, child in module.named_children()
        ]
        stack.extend(reversed(children))
    by_threshold = granularity_threshold > 0 and any(id(m) not in explicit for _, m in selected)
    n_blocks = sum(1 for _, m in selected if id(m) in blocks and id(m) not in explicit)
    return LeafSelection(
        tuple(selected), tuple(unmatched), None if by_threshold else finest, tuple(substituted), n_blocks
    )


def report_leaf_selection(root: nn.Module, selection: LeafSelection, granularity_threshold: int) -> None:
    """Log (rank 0) what the config selected, unmatched entries, substituted containers, and a threshold that
    selected nothing."""
    for entry in selection.unmatched:
        log_dist(entry.message(root), ranks=[0], level=logging.WARNING)
    for container, enclosing in selection.substituted:
        log_dist(
            f"{LEAF_MODULE_KEY}: {container!r} defines no forward (a container), so ZeRO-3 makes its nearest "
            f"enclosing module {enclosing!r} the leaf instead",
            ranks=[0],
            level=logging.WARNING,
        )
    if granularity_threshold > 0 and selection.finest is not None:
        name, value = selection.finest
        log_dist(
            f"{GRANULARITY_KEY}={granularity_threshold} selects no module: the finest candidate is "
            f"{name!r} with {value:.1f} parameter elements per module; a threshold above that makes it a leaf",
            ranks=[0],
            level=logging.WARNING,
        )
    if selection.modules:
        shown = ", ".join(name or "<root>" for name, _ in selection.modules[:8])
        more = f" (+{len(selection.modules) - 8} more)" if len(selection.modules) > 8 else ""
        blocks = f"; {selection.repeated_blocks} of them repeated blocks (lean_block_fetch_units)"
        log_dist(
            f"ZeRO-3 leaf modules from the config: {shown}{more}{blocks if selection.repeated_blocks else ''}",
            ranks=[0],
            level=logging.INFO,
        )
