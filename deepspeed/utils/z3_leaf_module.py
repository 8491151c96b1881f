"""ZeRO-3 leaf modules: a leaf's whole subtree is gathered and released as one unit (upstream names).

Useful for modules whose children run in a data-dependent order (mixture-of-experts routers), which would
otherwise invalidate the prefetch trace every step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from deepspeed._core.params.leaf_policy import class_entry_matches
from deepspeed._core.params.manager import Z3_LEAF_ATTR, is_z3_leaf

__all__ = [
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]


def z3_leaf_module(model: nn.Module) -> bool:
    """True when ``model`` is marked as a ZeRO-3 leaf."""
    return is_z3_leaf(model)


def z3_leaf_parameter(model: nn.Parameter) -> bool:
    """True when ``model`` (a parameter) belongs to a ZeRO-3 leaf module."""
    return hasattr(model, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """Every module of ``model`` marked as a leaf."""
    return [module for module in model.modules() if is_z3_leaf(module)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Mark (``flag=True``) or unmark one module."""
    setattr(model, Z3_LEAF_ATTR, flag)


def _mark(
    model: nn.Module, matches: Callable[[str, nn.Module], bool], flag: bool, what: str, raise_if_not_found: bool
) -> list[nn.Module]:
    found = []
    for name, module in model.named_modules():
        if matches(name, module):
            set_z3_leaf_module(module, flag)
            found.append(module)
    if not found and raise_if_not_found:
        raise ValueError(f"no module matching {what} found in {type(model).__name__}")
    return found


def _class_matcher(leaf_module_classes: Sequence[type | str]) -> Callable[[str, nn.Module], bool]:
    # A class object matches subclasses too; a string names the exact class, bare or fully qualified.
    classes = tuple(c for c in leaf_module_classes if isinstance(c, type))
    names = [c for c in leaf_module_classes if isinstance(c, str)]
    return lambda name, module: isinstance(module, classes) or any(class_entry_matches(n, module) for n in names)


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Mark every module of the given classes as a leaf; return them.

    A class object also matches its subclasses; a string matches the exact class by bare or fully qualified name.
    The config key ``zero_optimization.leaf_module.classes`` matches strings the same way
    (``_core/params/leaf_policy``).
    """
    return _mark(model, _class_matcher(leaf_module_classes), True, str(list(leaf_module_classes)), raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Unmark every module of the given classes; return them."""
    return _mark(model, _class_matcher(leaf_module_classes), False, str(list(leaf_module_classes)), raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules with these qualified names; return them and the names not found."""
    wanted = set(module_names)
    found = _mark(model, lambda name, module: name in wanted, flag, str(sorted(wanted)), raise_if_not_found)
    present = {name for name, _ in model.named_modules()}
    return found, sorted(wanted - present)


def set_z3_leaf_modules_by_suffix(
    model: nn.Module, module_name_suffixes: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules whose qualified names end with one of the suffixes; return them and unused suffixes."""
    suffixes = tuple(module_name_suffixes)
    found = _mark(model, lambda name, module: name.endswith(suffixes), flag, str(list(suffixes)), raise_if_not_found)
    names = [name for name, _ in model.named_modules()]
    return found, [s for s in suffixes if not any(n.endswith(s) for n in names)]
