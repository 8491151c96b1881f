"""The benchmarks stay a small harness beside the product, and measure the engine as users run it.

``benchmarks/`` holds at most ``MAX_FILES`` tracked files and ``benchmarks/results`` at most ``MAX_RESULTS`` (the
current record: older measurements live in the git history); no file is longer than ``MAX_LINES`` lines and no
function longer than ``MAX_FUNCTION_LINES`` (the package's budgets). A benchmark never changes the engine from the
outside: it neither assigns to an attribute of anything imported from ``deepspeed`` nor calls ``setattr`` on it
(an A/B of a behaviour goes through a documented config key), and imports no private name (``_x``) from
``deepspeed._core``.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
MAX_FILES = 60
MAX_RESULTS = 20
MAX_LINES = 800
MAX_FUNCTION_LINES = 100


def _tracked() -> list[Path]:
    """Files of ``benchmarks/`` as git tracks them (the working tree's files where git is not there)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "benchmarks"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return [p for p in BENCH.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    return [ROOT / p for p in out if (ROOT / p).exists()]


def _python_files() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*.py") if "__pycache__" not in p.parts)


def test_file_counts() -> None:
    files = _tracked()
    assert len(files) <= MAX_FILES, f"benchmarks/ holds {len(files)} files (at most {MAX_FILES})"
    results = [p for p in files if (BENCH / "results") in p.parents]
    assert len(results) <= MAX_RESULTS, f"benchmarks/results holds {len(results)} files (at most {MAX_RESULTS})"


def test_file_lengths() -> None:
    long = []
    for path in _tracked():
        if path.suffix in (".png", ".whl"):
            continue
        lines = path.read_text(errors="replace").count("\n")
        if lines > MAX_LINES:
            long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert not long, f"files over {MAX_LINES} lines:\n" + "\n".join(long)


def test_function_lengths() -> None:
    long = []
    for path in _python_files():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {length} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def _root_name(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def patches(source: str) -> list[str]:
    """Where ``source`` changes something it imported from ``deepspeed`` or imports a private ``_core`` name."""
    tree = ast.parse(source)
    bound: set[str] = set()
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "deepspeed"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deepspeed":
            bound |= {a.asname or a.name for a in node.names}
            if (node.module or "").startswith("deepspeed._core"):
                found += [f"line {node.lineno}: imports private {a.name}" for a in node.names if a.name[0] == "_"]
    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            if isinstance(target, (ast.Attribute, ast.Subscript)) and _root_name(target) in bound:
                found.append(f"line {node.lineno}: assigns into {ast.unparse(target)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if node.args and _root_name(node.args[0]) in bound:
                found.append(f"line {node.lineno}: {node.func.id} on {ast.unparse(node.args[0])}")
    return found


def test_benchmarks_do_not_patch_the_engine() -> None:
    found = [f"{p.relative_to(ROOT)} {where}" for p in _python_files() for where in patches(p.read_text())]
    assert not found, "benchmarks change the engine from outside (use a documented config key):\n" + "\n".join(found)


@pytest.mark.parametrize(
    "source, hits",
    [
        ("from deepspeed._core.optim.sharded import ShardedOptimizer\nShardedOptimizer._step = None\n", 1),
        ("from deepspeed._core.optim import chunked_step\nchunked_step.LIMIT = 1 << 62\n", 1),
        ("from deepspeed._core.grads import convert as c\nc.BLOCK += 1\n", 1),
        ("import deepspeed\nsetattr(deepspeed.comm, 'x', 1)\n", 1),
        ("from deepspeed._core.params import _private\n", 1),
        ("import deepspeed\nengine = deepspeed.initialize()\nconfig = {'zero': 1}\nrecord = {}\nrecord['x'] = 1\n", 0),
        ("import torch\ntorch.backends.cudnn.benchmark = True\n", 0),
    ],
)
def test_patch_finder(source: str, hits: int) -> None:
    """The check finds each form of patching and leaves ordinary code alone."""
    assert len(patches(source)) == hits, patches(source)
