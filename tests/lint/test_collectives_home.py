"""Collectives have one home in the core: ``deepspeed/_core/comm/collectives.py``.

The other rooms call its functions (``start_all_gather``, ``start_reduce_scatter``, ``sum_over`` ...), never
``dist.<collective>`` themselves, so that what goes over the wire, and where the host waits for it, is read in one
module. Two kinds of call stay where they are, by design: the pipeline's point-to-point transport (``pipe/p2p.py``
is that transport) and object collectives that agree on Python values in control-plane checks.
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "deepspeed" / "_core"
HOME = CORE / "comm" / "collectives.py"
TENSOR_COLLECTIVES = {
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "scatter",
    "gather",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
}
POINT_TO_POINT = {"send", "recv", "isend", "irecv"}
ALLOWED_POINT_TO_POINT = {CORE / "pipe" / "p2p.py"}


def collective_calls(path: Path) -> list[tuple[int, str]]:
    """``(line, name)`` of every ``dist.<name>(...)`` call in ``path`` whose name is a tensor collective."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "dist"
            and node.func.attr in TENSOR_COLLECTIVES
        ):
            found.append((node.lineno, node.func.attr))
    return found


def test_the_core_calls_collectives_only_through_the_collectives_module() -> None:
    offenders = []
    for path in sorted(CORE.rglob("*.py")):
        if path == HOME:
            continue
        for line, name in collective_calls(path):
            if name in POINT_TO_POINT and path in ALLOWED_POINT_TO_POINT:
                continue
            offenders.append(f"{path.relative_to(CORE)}:{line}: dist.{name}")
    assert not offenders, "collectives outside comm/collectives.py:\n" + "\n".join(offenders)


def test_the_checker_sees_a_collective(tmp_path: Path) -> None:
    """The scan is not vacuous: a direct call is found, an object collective and a method of another name are not."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from deepspeed import comm as dist\n"
        "def f(t, g):\n"
        "    dist.all_reduce(t, group=g)\n"
        "    dist.all_gather_object([None], 1)\n"
        "    dist.get_rank()\n"
    )
    assert collective_calls(sample) == [(3, "all_reduce")]
    assert collective_calls(HOME), "the home module itself issues them"
