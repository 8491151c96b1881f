"""Tools sit beside the core, never inside it (docs/design/conventions.md, "Layering").

``deepspeed/_core`` never imports ``deepspeed.tools`` -- not by an import statement, not by a module name handed to
``importlib`` -- so a tool can change (or be absent) without touching training; the engine façade hands a tool to
the core through an interface the core defines (``SnapshotAnalyser`` in ``deepspeed/_core/engine/memory.py``).
The memory-timeline package must also stay loadable by path in a process running another DeepSpeed, or none: it
imports the standard library and its own modules only.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "deepspeed" / "_core"
TIMELINE = ROOT / "deepspeed" / "tools" / "profiling" / "memory_timeline"
TOOLS = "deepspeed.tools"


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _docstring_nodes(tree: ast.Module) -> set[int]:
    """ids of the docstring constants of ``tree`` (they may name a tool without importing it)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def tool_references(tree: ast.Module) -> list[int]:
    """Lines of ``tree`` that import ``deepspeed.tools`` or name it in a string (e.g. for ``importlib``)."""
    lines: list[int] = []
    docstrings = _docstring_nodes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            lines.extend(node.lineno for alias in node.names if _is_tools(alias.name))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level == 0 and (_is_tools(base) or any(_is_tools(f"{base}.{a.name}") for a in node.names)):
                lines.append(node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if _is_tools(node.value) or "deepspeed/tools" in node.value:
                lines.append(node.lineno)
    return lines


def _is_tools(name: str) -> bool:
    return name == TOOLS or name.startswith(TOOLS + ".")


def test_core_never_imports_tools() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted(CORE.rglob("*.py"))
        for line in tool_references(_parse(path))
    ]
    assert not offenders, f"deepspeed/_core must not import deepspeed.tools: {offenders}"


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import deepspeed.tools.profiling.memory_timeline as mt", 1),
        ("from deepspeed.tools.profiling import memory_timeline", 1),
        ("from deepspeed import tools", 1),
        ("import importlib\nmt = importlib.import_module('deepspeed.tools.profiling.memory_timeline')", 1),
        ("from deepspeed._core.engine import memory", 0),
        ("from deepspeed import toolsmith", 0),
        (
            'def f() -> None:\n    """The report is written by deepspeed.tools.profiling (handed in by the façade)."""',
            0,
        ),
    ],
)
def test_detector_catches_tool_imports(source: str, expected: int) -> None:
    assert len(tool_references(ast.parse(source))) == expected


def test_memory_timeline_imports_only_the_standard_library() -> None:
    offenders = []
    for path in sorted(TIMELINE.glob("*.py")):
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            # matplotlib is the one exception, imported inside the chart function only (checked by the unit tests).
            offenders.extend(
                f"{path.name}:{node.lineno} {name}"
                for name in names
                if name.split(".")[0] not in sys.stdlib_module_names and not name.startswith("matplotlib")
            )
    assert not offenders, offenders
