"""Mechanical guard rails for the package's layering and size budgets.

Each rule comes from docs/design/conventions.md. The checks parse the source with :mod:`ast`, so
comments and docstrings never trigger them, and they need neither torch nor a process group.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "deepspeed"

# The one module that imports torch.distributed (the backend behind deepspeed.comm).
TORCH_DISTRIBUTED_HOME = "_core/comm/backend.py"
# Command-line entry points whose job is to print to a terminal.
PRINT_ALLOWED = {"env_report.py", "launcher/runner.py", "launcher/launch.py"}
MAX_FILE_LINES = 800
MAX_FUNCTION_CODE_LINES = 100


def _sources() -> list[Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _rel(path: Path) -> str:
    return path.relative_to(PKG).as_posix()


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imported_modules(tree: ast.Module, path: Path) -> list[tuple[int, str]]:
    """Absolute names of every module imported by ``tree`` (relative imports resolved)."""
    found: list[tuple[int, str]] = []
    package_parts = ["deepspeed", *path.relative_to(PKG).parent.parts]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package_parts[: len(package_parts) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            found.append((node.lineno, base))
            # `from deepspeed import comm` imports the submodule deepspeed.comm.
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
    return found


def _code_lines(node: ast.AST, source_lines: list[str]) -> int:
    """Lines of a function body that are neither blank, comments, nor its docstring."""
    body = node.body  # type: ignore[attr-defined]
    start = body[0].lineno
    if isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        start = body[0].end_lineno + 1  # skip the docstring
    count = 0
    for line in source_lines[start - 1 : node.end_lineno]:
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            count += 1
    return count


def test_torch_distributed_confined_to_comm_backend() -> None:
    bad = []
    for path in _sources():
        if _rel(path) == TORCH_DISTRIBUTED_HOME:
            continue
        for lineno, name in _imported_modules(_parse(path), path):
            if name == "torch.distributed" or name.startswith("torch.distributed."):
                bad.append(f"{_rel(path)}:{lineno} imports {name}")
    assert not bad, f"only deepspeed/{TORCH_DISTRIBUTED_HOME} may import torch.distributed:\n" + "\n".join(bad)


def _touches_torch_cuda(tree: ast.Module, path: Path) -> list[int]:
    lines = [ln for ln, name in _imported_modules(tree, path) if name == "torch.cuda" or name.startswith("torch.cuda.")]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "cuda"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        ):
            lines.append(node.lineno)
    return lines


def test_torch_cuda_confined_to_accelerator() -> None:
    bad = []
    for path in _sources():
        if _rel(path).startswith("accelerator/"):
            continue
        bad.extend(f"{_rel(path)}:{ln}" for ln in _touches_torch_cuda(_parse(path), path))
    assert not bad, "only deepspeed/accelerator may touch torch.cuda:\n" + "\n".join(bad)


def test_no_record_stream() -> None:
    bad = []
    for path in _sources():
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Attribute) and node.attr == "record_stream":
                bad.append(f"{_rel(path)}:{node.lineno}")
    assert not bad, "record_stream is banned; order frees with events (docs/design/streams.md):\n" + "\n".join(bad)


def test_no_print_in_library_code() -> None:
    bad = []
    for path in _sources():
        if _rel(path) in PRINT_ALLOWED:
            continue
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                bad.append(f"{_rel(path)}:{node.lineno}")
    assert not bad, "use deepspeed.utils.logging instead of print():\n" + "\n".join(bad)


def test_file_length_budget() -> None:
    long_files = [
        f"{_rel(p)}: {n} lines" for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    ]
    assert not long_files, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(long_files)


def test_function_length_budget() -> None:
    bad = []
    for path in _sources():
        lines = path.read_text().splitlines()
        for node in ast.walk(_parse(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = _code_lines(node, lines)
                if n > MAX_FUNCTION_CODE_LINES:
                    bad.append(f"{_rel(path)}:{node.lineno} {node.name}: {n} code lines")
    assert not bad, f"functions over {MAX_FUNCTION_CODE_LINES} code lines:\n" + "\n".join(bad)


def test_core_arguments_are_annotated() -> None:
    missing = []
    total = 0
    for path in _sources():
        if not _rel(path).startswith("_core/"):
            continue
        for node in ast.walk(_parse(path)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            args = node.args
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
            every += [a for a in (args.vararg, args.kwarg) if a is not None]
            for a in every:
                if a.arg in ("self", "cls"):
                    continue
                total += 1
                if a.annotation is None:
                    missing.append(f"{_rel(path)}:{node.lineno} {node.name}({a.arg})")
    assert not missing, "unannotated arguments in deepspeed/_core:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import torch\nx = torch.cuda.current_stream()\n", 1),
        ("from torch import cuda\n", 1),
        ("import torch.cuda\n", 1),
    ],
)
def test_cuda_detector_catches_direct_use(source: str, expected: int) -> None:
    """The detector itself must fire, or the confinement test above could never fail."""
    probe = PKG / "runtime" / "probe.py"  # never written: only used to resolve relative imports
    found = _touches_torch_cuda(ast.parse(source), probe)
    assert len(found) == expected


# --- layers of deepspeed/ -------------------------------------------------------------------------------------------
# Each top-level unit of the package (a folder, or a module file directly in deepspeed/; "deepspeed" is the package's
# own __init__.py) sits in one layer, lowest first. A module imports only units of its own layer or of lower ones,
# and the units' import graph has no cycle (docs/design/foundation.md states the layers and why).
LAYERS: tuple[tuple[str, frozenset[str]], ...] = (
    # Imports nothing of deepspeed: the logger, the launcher's environment, version and refusal stubs.
    ("foundation", frozenset({"_foundation", "git_version_info", "unsupported"})),
    # The device: the only place that touches torch.cuda.
    ("accelerator", frozenset({"accelerator"})),
    # Kernels and their builders.
    ("ops", frozenset({"ops"})),
    # The implementation, in rooms (ROOM_IMPORTS below), the torch.distributed backend included.
    ("core", frozenset({"_core"})),
    # Public homes with upstream's names over one concern each: façades over the core.
    (
        "surface",
        frozenset({"checkpoint", "comm", "launcher", "moe", "monitor", "profiling", "sequence", "tools", "utils"}),
    ),
    # The engine's public homes (deepspeed.runtime, deepspeed.zero), which compose the surface packages.
    ("runtime", frozenset({"runtime"})),
    # deepspeed.pipe re-exports the pipeline engine's runtime home.
    ("pipe", frozenset({"pipe"})),
    # Entry points: the package root (deepspeed.initialize ...) and ds_report.
    ("entry", frozenset({"deepspeed", "env_report"})),
)
LAYER_OF: dict[str, int] = {unit: i for i, (_, units) in enumerate(LAYERS) for unit in units}
# Imports that go against the layers today, each (file, unit it imports), with the reason. An entry is removed when
# its import goes (test_known_layer_exceptions_are_current fails on a stale one).
LAYER_EXCEPTIONS: dict[tuple[str, str], str] = {}


def _units_on_disk() -> set[str]:
    units = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    return units | {p.stem for p in PKG.glob("*.py") if p.name != "__init__.py"} | {"deepspeed"}


def _unit_of_file(rel: str) -> str:
    """The top-level unit of a path relative to deepspeed/."""
    return "deepspeed" if rel == "__init__.py" else rel.split("/")[0].removesuffix(".py")


def _unit_imports(tree: ast.Module, path: Path, units: set[str]) -> list[tuple[int, str, str]]:
    """``(line, unit, module)`` for every import of a deepspeed unit in ``tree`` (relative imports resolved).

    ``from deepspeed import X`` imports the unit X when X is one, else a name of the package root.
    """
    found: list[tuple[int, str, str]] = []
    for lineno, name in _imported_modules(tree, path):
        parts = name.split(".")
        if parts[0] != "deepspeed" or len(parts) == 1:
            continue  # the bare root of `from deepspeed import X` is judged by its X
        found.append((lineno, parts[1] if parts[1] in units else "deepspeed", name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, "deepspeed", a.name) for a in node.names if a.name == "deepspeed")
    return found


def _layer_violations(path: Path, tree: ast.Module, units: set[str]) -> list[str]:
    """``file:line unit (layer) -> unit (layer) (module)`` for every import of ``tree`` that goes up a layer."""
    rel = _rel(path)
    source = _unit_of_file(rel)
    if source not in LAYER_OF:
        return [f"{rel}: {source!r} is not in LAYERS (place it in a layer first)"]
    first: dict[tuple[int, str], str] = {}
    for lineno, target, name in _unit_imports(tree, path, units):
        if target == source or (rel, target) in LAYER_EXCEPTIONS:
            continue
        if target in LAYER_OF and LAYER_OF[target] <= LAYER_OF[source]:
            continue
        key = (lineno, target)
        first[key] = min(first.get(key, name), name, key=len)
    layer = LAYERS[LAYER_OF[source]][0]
    return [
        f"{rel}:{lineno} {source} ({layer}) -> {target} ({LAYERS[LAYER_OF[target]][0] if target in LAYER_OF else '?'})"
        f" ({name})"
        for (lineno, target), name in sorted(first.items())
    ]


def _unit_import_edges() -> dict[tuple[str, str], list[str]]:
    """Every import between two top-level units today: ``{(unit, imported unit): [file:line, ...]}``."""
    units = _units_on_disk()
    edges: dict[tuple[str, str], list[str]] = {}
    for path in _sources():
        source = _unit_of_file(_rel(path))
        for lineno, target, _ in _unit_imports(_parse(path), path, units):
            if target != source:
                edges.setdefault((source, target), []).append(f"{_rel(path)}:{lineno}")
    return edges


def test_no_module_imports_a_higher_layer() -> None:
    units = _units_on_disk()
    bad = []
    for path in _sources():
        bad.extend(_layer_violations(path, _parse(path), units))
    assert not bad, "an import goes up the layers (LAYERS in this file, docs/design/foundation.md):\n" + "\n".join(bad)


def test_every_top_level_unit_is_placed() -> None:
    placed = set(LAYER_OF)
    assert _units_on_disk() == placed, f"units on disk {sorted(_units_on_disk())} != LAYERS {sorted(placed)}"
    assert sum(len(units) for _, units in LAYERS) == len(placed), "a unit is placed in two layers"


def test_top_level_import_graph_has_no_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for (source, target), sites in _unit_import_edges().items():
        if any((site.rsplit(":", 1)[0], target) not in LAYER_EXCEPTIONS for site in sites):
            graph.setdefault(source, set()).add(target)
    cycle = _find_cycle(graph)
    assert cycle is None, "the top-level units import each other in a cycle: " + " -> ".join(cycle or [])


def test_known_layer_exceptions_are_current() -> None:
    edges = _unit_import_edges()
    present = {(site.rsplit(":", 1)[0], target) for (_, target), sites in edges.items() for site in sites}
    stale = sorted(f"{f} -> {unit}" for f, unit in LAYER_EXCEPTIONS if (f, unit) not in present)
    assert not stale, "LAYER_EXCEPTIONS lists imports that no longer exist; remove them:\n" + "\n".join(stale)
    for f, unit in LAYER_EXCEPTIONS:
        assert LAYER_OF[unit] > LAYER_OF[_unit_of_file(f)], f"{f} -> {unit} is allowed anyway"


@pytest.mark.parametrize(
    "rel, source, expected",
    [
        # The core importing a façade, absolutely, relatively and through the package root.
        (
            "_core/optim/probe.py",
            "from deepspeed import comm as dist\n",
            ["_core/optim/probe.py:1 _core (core) -> comm (surface) (deepspeed.comm)"],
        ),
        (
            "_core/params/probe.py",
            "def f():\n    from ...runtime.zero import config\n",
            ["_core/params/probe.py:2 _core (core) -> runtime (runtime) (deepspeed.runtime.zero)"],
        ),
        (
            "accelerator/probe.py",
            "import deepspeed\nfrom deepspeed import initialize\n",
            [
                "accelerator/probe.py:1 accelerator (accelerator) -> deepspeed (entry) (deepspeed)",
                "accelerator/probe.py:2 accelerator (accelerator) -> deepspeed (entry) (deepspeed.initialize)",
            ],
        ),
        (
            "_foundation/probe.py",
            "from deepspeed.utils.logging import logger\n",
            ["_foundation/probe.py:1 _foundation (foundation) -> utils (surface) (deepspeed.utils.logging)"],
        ),
        # Allowed: downwards, within a layer, within a unit, and outside the package.
        ("runtime/probe.py", "from deepspeed._core.engine import training\nfrom deepspeed import comm\n", []),
        ("moe/probe.py", "from deepspeed.utils import groups\nfrom . import layer\nimport torch\n", []),
        # A unit the table does not know fails on its own.
        ("newpkg/probe.py", "import os\n", ["newpkg/probe.py: 'newpkg' is not in LAYERS (place it in a layer first)"]),
    ],
)
def test_layer_checker_fires_on_forbidden_edges(rel: str, source: str, expected: list[str]) -> None:
    """The checker itself must fire, or the layer test above could never fail."""
    probe = PKG / rel  # never written: the path only places the source in a unit and resolves relative imports
    assert _layer_violations(probe, ast.parse(source), _units_on_disk()) == expected


# --- constructors of deepspeed/_core --------------------------------------------------------------------------------
# A class of the core is built from few, typed arguments: its __init__ spans at most MAX_CONSTRUCTOR_LINES lines
# (from `def` to its last line, the docstring not counted), takes at most MAX_CONSTRUCTOR_PARAMS parameters besides
# self, and no bare `bool` (an enum or a frozen policy names what the flag means at the call site).
MAX_CONSTRUCTOR_LINES = 40
MAX_CONSTRUCTOR_PARAMS = 8
# Classes whose public signature upstream fixes (third-party code constructs them with upstream's arguments): the
# parameter count and bool rules do not apply to them; the line budget does.
UPSTREAM_SIGNATURES: dict[str, str] = {
    "DeepSpeedConfigModel": "deepspeed.runtime.config_utils.DeepSpeedConfigModel(strict=False, **data)",
    "DynamicLossScaler": "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler(init_scale, ..., dtype)",
    "MOELayer": "deepspeed.moe.sharded_moe.MOELayer(gate, experts, ep_group_name, ep_size, num_local_experts, ...)",
    "MoECore": "the body of deepspeed.moe.layer.MoE, whose upstream arguments it takes as they are",
    "PipelineModule": "deepspeed.pipe.PipelineModule(layers, num_stages, topology, loss_fn, seed_layers, ...)",
    "TopKGate": "deepspeed.moe.sharded_moe.TopKGate(model_dim, num_experts, k, ..., drop_tokens, use_rts, ...)",
    "ThroughputTimer": "deepspeed.utils.timer.ThroughputTimer(config, batch_size, ..., monitor_memory=False, ...)",
    "UlyssesSPAttentionHF": "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF(attn, batch_size, "
    "attn_head_count, ..., seq_length_is_variable, local_seq_length, global_seq_length, disable_in_eval)",
}


def _is_bool(annotation: ast.expr | None) -> bool:
    """True for ``bool`` and for a union that admits it (``bool | None``)."""
    if isinstance(annotation, ast.Name):
        return annotation.id == "bool"
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return _is_bool(ast.parse(annotation.value, mode="eval").body)
    if isinstance(annotation, ast.BinOp):
        return _is_bool(annotation.left) or _is_bool(annotation.right)
    return False


def _constructor_findings(tree: ast.Module, rel: str) -> list[str]:
    """``file:line Class: finding`` for every constructor of ``tree`` over the budget."""
    found = []
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for init in (f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"):
            where = f"{rel}:{init.lineno} {cls.name}"
            lines = init.end_lineno - init.lineno + 1  # type: ignore[operator]
            first = init.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                lines -= first.end_lineno - first.lineno + 1  # type: ignore[operator]
            if lines > MAX_CONSTRUCTOR_LINES:
                found.append(f"{where}: {lines} lines (budget {MAX_CONSTRUCTOR_LINES})")
            if cls.name in UPSTREAM_SIGNATURES:
                continue
            a = init.args
            params = [p for p in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg) if p is not None]
            params = [p for p in params if p.arg != "self"]
            if len(params) > MAX_CONSTRUCTOR_PARAMS:
                found.append(f"{where}: {len(params)} parameters (budget {MAX_CONSTRUCTOR_PARAMS})")
            found.extend(f"{where}: bare bool parameter {p.arg!r}" for p in params if _is_bool(p.annotation))
    return found


def _core_classes() -> dict[str, list[str]]:
    classes: dict[str, list[str]] = {}
    for path in _sources():
        if _rel(path).startswith("_core/"):
            for node in ast.walk(_parse(path)):
                if isinstance(node, ast.ClassDef):
                    classes.setdefault(node.name, []).append(_rel(path))
    return classes


def test_core_constructors_keep_the_budget() -> None:
    bad = []
    for path in _sources():
        if _rel(path).startswith("_core/"):
            bad.extend(_constructor_findings(_parse(path), _rel(path)))
    assert not bad, "constructors of deepspeed/_core over the budget (docs/design/foundation.md):\n" + "\n".join(bad)


def test_upstream_signatures_are_current() -> None:
    """Every allowlisted class exists in the core and needs the exemption (more parameters, or a bool one)."""
    classes = _core_classes()
    missing = sorted(name for name in UPSTREAM_SIGNATURES if name not in classes)
    assert not missing, f"UPSTREAM_SIGNATURES names classes the core does not define: {missing}"
    saved = dict(UPSTREAM_SIGNATURES)
    try:
        UPSTREAM_SIGNATURES.clear()
        needed = {
            f.split(" ")[1].rstrip(":")
            for path in _sources()
            if _rel(path).startswith("_core/")
            for f in _constructor_findings(_parse(path), _rel(path))
        }
    finally:
        UPSTREAM_SIGNATURES.update(saved)
    idle = sorted(set(saved) - needed)
    assert not idle, f"UPSTREAM_SIGNATURES lists classes that keep the budget anyway; remove them: {idle}"


@pytest.mark.parametrize(
    "source, expected",
    [
        (
            "class A:\n    def __init__(self, a: int, b: bool = False) -> None:\n        self.a = a\n",
            ["_core/probe.py:2 A: bare bool parameter 'b'"],
        ),
        (
            "class B:\n    def __init__(self, flag: bool | None, *rest: int) -> None:\n        pass\n",
            ["_core/probe.py:2 B: bare bool parameter 'flag'"],
        ),
        (
            "class C:\n    def __init__(self, "
            + ", ".join(f"p{i}: int" for i in range(9))
            + ") -> None:\n        pass\n",
            ["_core/probe.py:2 C: 9 parameters (budget 8)"],
        ),
        (
            "class D:\n    def __init__(self) -> None:\n        '''Doc.\n\n        More.\n        '''\n"
            + "        x = 1\n" * 40,
            ["_core/probe.py:2 D: 41 lines (budget 40)"],
        ),
        # Within the budget: a policy enum, 8 parameters, 39 lines of body, and an upstream signature.
        ("class E:\n    def __init__(self, mode: Mode, *, n: int = 1) -> None:\n        pass\n", []),
        ("class F:\n    def __init__(self) -> None:\n" + "        x = 1\n" * 39, []),
        ("class PipelineModule:\n    def __init__(self, seed_layers: bool = False) -> None:\n        pass\n", []),
    ],
)
def test_constructor_checker_fires(source: str, expected: list[str]) -> None:
    """The checker itself must fire, or the budget test above could never fail."""
    assert _constructor_findings(ast.parse(source), "_core/probe.py") == expected


# --- rooms of deepspeed/_core ---------------------------------------------------------------------------------------
# Each room (a folder under _core, or a file directly in it) and the rooms it may import. The direction is
#   config -> layout -> comm -> moe -> params -> grads -> optim -> checkpoint -> sequence -> engine -> pipe
# (a room imports only rooms to its left). sequence (tiled compute, sequence parallelism) sits below engine, which
# wires it into training. moe sits low: its layers and expert groups need only the communication
# layer, and the ZeRO optimizers and checkpoints partition and save expert groups. engine and pipe are on top
# (the pipeline engine reuses the engine's precision and checkpoint pieces).
_ROOM_ORDER = (
    "config",
    "layout",
    "comm",
    "moe",
    "params",
    "grads",
    "optim",
    "checkpoint",
    "sequence",
    "observe",
    "engine",
    "pipe",
)
ROOM_IMPORTS: dict[str, frozenset[str]] = {room: frozenset(_ROOM_ORDER[:i]) for i, room in enumerate(_ROOM_ORDER)}
# Imports that go against the direction today, each (file, room it imports). They are listed so the rule can hold
# everywhere else; an entry is removed when its import goes (test_known_room_exceptions_are_current fails on a
# stale one), and none is added without a reason here.
ROOM_EXCEPTIONS: dict[tuple[str, str], str] = {
    ("_core/config/batch.py", "comm"): "the batch triangle needs the live group's world size when a config is read "
    "after the process group started (imported lazily: a config can be read with no group)",
    ("_core/config/enforce.py", "comm"): "the once-per-run warning for unknown top-level keys asks the live group "
    "which rank is first (imported lazily, as in batch.py)",
}


def _room_of_file(rel: str) -> str | None:
    """The room of a path relative to deepspeed/ (``None`` outside _core and for _core/__init__.py)."""
    parts = rel.split("/")
    if parts[0] != "_core" or rel == "_core/__init__.py":
        return None
    return parts[1].removesuffix(".py")


def _room_of_module(name: str) -> str | None:
    """The room of an absolute module name (``None`` outside _core, and for the bare ``deepspeed._core``)."""
    parts = name.split(".")
    if parts[:2] != ["deepspeed", "_core"] or len(parts) < 3:
        return None
    return parts[2]


def _room_violations(path: Path, tree: ast.Module) -> list[str]:
    """``file:line room -> room (module)`` for every import of ``tree`` that its room may not make."""
    rel = _rel(path)
    room = _room_of_file(rel)
    if room is None:
        return []
    allowed = ROOM_IMPORTS.get(room)
    if allowed is None:
        return [f"{rel}: room {room!r} is not in ROOM_IMPORTS (place it in the direction first)"]
    # One line per import statement and room: `from a.b import c` also yields a.b.c, which names no new edge.
    first: dict[tuple[int, str], str] = {}
    for lineno, name in _imported_modules(tree, path):
        target = _room_of_module(name)
        if target is None or target == room or target in allowed or (rel, target) in ROOM_EXCEPTIONS:
            continue
        key = (lineno, target)
        first[key] = min(first.get(key, name), name, key=len)
    return [f"{rel}:{lineno} {room} -> {target} ({name})" for (lineno, target), name in sorted(first.items())]


def _core_import_edges() -> dict[tuple[str, str], list[str]]:
    """Every room-to-room import in _core today: ``{(room, imported room): [file:line, ...]}``."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in _sources():
        room = _room_of_file(_rel(path))
        if room is None:
            continue
        for lineno, name in _imported_modules(_parse(path), path):
            target = _room_of_module(name)
            if target is not None and target != room:
                edges.setdefault((room, target), []).append(f"{_rel(path)}:{lineno}")
    return edges


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or ``None`` when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for succ in sorted(graph.get(node, ())):
            if state.get(succ) == 1:
                return path[path.index(succ) :] + [succ]
            if succ not in state and (found := visit(succ)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_core_rooms_import_only_lower_rooms() -> None:
    bad = []
    for path in _sources():
        bad.extend(_room_violations(path, _parse(path)))
    assert not bad, "a _core room imports a room it may not (ROOM_IMPORTS in this file):\n" + "\n".join(bad)


def test_every_core_room_is_placed() -> None:
    rooms = {p.name for p in (PKG / "_core").iterdir() if p.is_dir() and p.name != "__pycache__"}
    rooms |= {p.stem for p in (PKG / "_core").glob("*.py") if p.name != "__init__.py"}
    assert rooms == set(ROOM_IMPORTS), f"rooms on disk {sorted(rooms)} != ROOM_IMPORTS {sorted(ROOM_IMPORTS)}"


def test_room_table_follows_the_direction_and_has_no_cycle() -> None:
    graph = {room: set(allowed) for room, allowed in ROOM_IMPORTS.items()}
    assert _find_cycle(graph) is None
    for room, allowed in ROOM_IMPORTS.items():
        if room in _ROOM_ORDER:
            assert allowed == set(_ROOM_ORDER[: _ROOM_ORDER.index(room)]), room


def test_core_import_graph_has_no_cycle_outside_the_listed_exceptions() -> None:
    graph: dict[str, set[str]] = {}
    for (room, target), sites in _core_import_edges().items():
        if any(not _is_exception(site, target) for site in sites):
            graph.setdefault(room, set()).add(target)
    cycle = _find_cycle(graph)
    assert cycle is None, "the _core room graph has a cycle: " + " -> ".join(cycle or [])


def _is_exception(site: str, target: str) -> bool:
    return (site.rsplit(":", 1)[0], target) in ROOM_EXCEPTIONS


def test_known_room_exceptions_are_current() -> None:
    edges = _core_import_edges()
    present = {(site.rsplit(":", 1)[0], target) for (_, target), sites in edges.items() for site in sites}
    stale = sorted(f"{f} -> {room}" for f, room in ROOM_EXCEPTIONS if (f, room) not in present)
    assert not stale, "ROOM_EXCEPTIONS lists imports that no longer exist; remove them:\n" + "\n".join(stale)
    for (f, room), _reason in ROOM_EXCEPTIONS.items():
        source = _room_of_file(f)
        assert source is not None and room not in ROOM_IMPORTS[source], f"{f} -> {room} is allowed anyway"


@pytest.mark.parametrize(
    "rel, source, expected",
    [
        # A lower room importing a higher one, absolute and relative, and through a package import.
        (
            "_core/layout/probe.py",
            "import torch\nfrom deepspeed._core.optim import base\n",
            ["_core/layout/probe.py:2 layout -> optim (deepspeed._core.optim)"],
        ),
        (
            "_core/params/probe.py",
            "def f():\n    from ..grads.reducer import GradReducer\n",
            ["_core/params/probe.py:2 params -> grads (deepspeed._core.grads.reducer)"],
        ),
        (
            "_core/config/probe.py",
            "import deepspeed._core.engine.training\nx = 1\nfrom ..pipe import module\n",
            [
                "_core/config/probe.py:1 config -> engine (deepspeed._core.engine.training)",
                "_core/config/probe.py:3 config -> pipe (deepspeed._core.pipe)",
            ],
        ),
        (
            "_core/comm/probe.py",
            "from deepspeed._core.params import param\n",
            ["_core/comm/probe.py:1 comm -> params (deepspeed._core.params)"],
        ),
        # Allowed: a higher room importing a lower one, a room importing itself, and imports outside _core.
        ("_core/optim/probe.py", "from deepspeed._core.grads import reducer\nfrom . import base\n", []),
        ("runtime/probe.py", "from deepspeed._core.pipe import executor\n", []),
        # A room the table does not know fails on its own.
        (
            "_core/tools/probe.py",
            "import os\n",
            ["_core/tools/probe.py: room 'tools' is not in ROOM_IMPORTS (place it in the direction first)"],
        ),
    ],
)
def test_room_checker_fires_on_forbidden_edges(rel: str, source: str, expected: list[str]) -> None:
    """The checker itself must fire, or the room test above could never fail."""
    probe = PKG / rel  # never written: the path only places the source in a room and resolves relative imports
    assert _room_violations(probe, ast.parse(source)) == expected


def test_cycle_finder_finds_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
