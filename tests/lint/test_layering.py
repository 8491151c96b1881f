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

# Modules the private core may depend on besides itself: infrastructure, not façades.
CORE_ALLOWED_PREFIXES = ("deepspeed._core", "deepspeed.accelerator", "deepspeed.comm", "deepspeed.utils.logging")
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


def test_core_never_imports_facades() -> None:
    bad = []
    for path in _sources():
        if not _rel(path).startswith("_core/"):
            continue
        for lineno, name in _imported_modules(_parse(path), path):
            if name == "deepspeed" or (name.startswith("deepspeed.") and not name.startswith(CORE_ALLOWED_PREFIXES)):
                # `from deepspeed import comm` yields both "deepspeed" and "deepspeed.comm": judge the submodule.
                if name == "deepspeed":
                    continue
                bad.append(f"{_rel(path)}:{lineno} imports {name}")
    assert not bad, "deepspeed/_core must not import façade modules:\n" + "\n".join(bad)


def test_torch_distributed_confined_to_comm_backend() -> None:
    bad = []
    for path in _sources():
        if _rel(path) == "comm/backend.py":
            continue
        for lineno, name in _imported_modules(_parse(path), path):
            if name == "torch.distributed" or name.startswith("torch.distributed."):
                bad.append(f"{_rel(path)}:{lineno} imports {name}")
    assert not bad, "only deepspeed/comm/backend.py may import torch.distributed:\n" + "\n".join(bad)


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


# Lower layers of _core never import higher ones (style.md §3: plan -> layout/buffers -> ... -> engine).
CORE_LOWER_LAYERS = {
    "_core/optim/": ("deepspeed._core.engine", "deepspeed._core.checkpoint"),
    "_core/grads/": ("deepspeed._core.engine", "deepspeed._core.optim.stage", "deepspeed._core.checkpoint"),
    "_core/params/": ("deepspeed._core.engine", "deepspeed._core.optim", "deepspeed._core.grads",
                      "deepspeed._core.checkpoint"),
    "_core/config/plan.py": ("deepspeed._core.engine", "deepspeed._core.params", "deepspeed._core.grads",
                             "deepspeed._core.optim"),
}


def test_core_dependency_direction() -> None:
    bad = []
    for path in _sources():
        rel = _rel(path)
        for prefix, banned in CORE_LOWER_LAYERS.items():
            if not rel.startswith(prefix):
                continue
            for lineno, name in _imported_modules(_parse(path), path):
                if name.startswith(banned):
                    bad.append(f"{rel}:{lineno} imports {name}")
    assert not bad, "a lower _core layer imports a higher one:\n" + "\n".join(bad)
