"""``ds_report``: the environment and the state of every native op.

Prints versions (python, torch, deepspeed), CUDA (torch's build, the toolkit), the accelerator,
whether ninja and a C++ compiler are found, then one row per op: compatible, built, and whether
the kernel or a fallback will run (with the reason).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Sequence

import torch

GREEN_YES, RED_NO = "[YES]", "[NO]"


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        return "not runnable"
    return out[-1] if cmd[0].endswith("nvcc") and out else (out[0] if out else "no output")


def _accelerator_line() -> str:
    try:
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        return f"{acc.device_name()} (available: {acc.is_available()}, backend: {acc.communication_backend_name()})"
    except Exception as err:  # noqa: BLE001 (the report must print even when the accelerator cannot be set up)
        return f"unavailable ({type(err).__name__}: {err})"


def environment_rows() -> list[tuple[str, str]]:
    """(label, value) rows describing this machine's software."""
    from torch.utils.cpp_extension import CUDA_HOME, is_ninja_available

    import deepspeed
    from deepspeed.ops.op_builder.builder import find_nvcc

    compiler = os.environ.get("CXX", "c++")
    nvcc = find_nvcc()
    return [
        ("python version", f"{platform.python_version()} ({sys.executable})"),
        ("torch version", f"{torch.__version__} ({os.path.dirname(torch.__file__)})"),
        ("torch cuda version", str(torch.version.cuda)),
        ("deepspeed version", f"{deepspeed.__version__} ({os.path.dirname(deepspeed.__file__)})"),
        ("deepspeed git", f"{deepspeed.__git_hash__} ({deepspeed.__git_branch__})"),
        ("accelerator", _accelerator_line()),
        (
            "nvcc",
            f"{nvcc} ({_first_line([nvcc, '--version'])}); torch's CUDA_HOME: {CUDA_HOME}" if nvcc else "not found",
        ),
        ("ninja", f"{GREEN_YES if is_ninja_available() else RED_NO} {shutil.which('ninja') or ''}".rstrip()),
        (
            "C++ compiler",
            f"{GREEN_YES} {_first_line([compiler, '--version'])}"
            if shutil.which(compiler)
            else f"{RED_NO} {compiler!r} not on PATH",
        ),
    ]


def op_rows() -> list[tuple[str, str, str, str]]:
    """(op, compatible, built, what runs) for every op in ``ALL_OPS``."""
    from deepspeed.ops.op_builder import ALL_OPS

    rows = []
    for name, builder in ALL_OPS.items():
        status = builder.status()
        if status.compatible:
            runs = "kernel" + ("" if status.built else " (JIT-compiled on first use)")
            cuda_missing = builder.cuda_reasons() if hasattr(builder, "cuda_reasons") else []
            if cuda_missing:
                runs += f"; CPU part only, CUDA tensors fall back to torch ({'; '.join(cuda_missing)})"
        else:
            runs = "falling back: " + "; ".join(status.reasons)
        if hasattr(builder, "backend") and status.compatible:
            runs += f"; backend: {builder.backend()}"
        rows.append((name, GREEN_YES if status.compatible else RED_NO, GREEN_YES if status.built else RED_NO, runs))
    return rows


def _print_table(rows: Sequence[tuple[str, ...]], header: tuple[str, ...]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        cells = [str(c).ljust(w) for c, w in zip(row[:-1], widths, strict=True)]
        sys.stdout.write(" | ".join([*cells, str(row[-1])]) + "\n")


def _op_warnings() -> list[str]:
    """Warnings of the ops that have any (async_io without libaio)."""
    from deepspeed.ops.op_builder import ALL_OPS

    return [line for builder in ALL_OPS.values() if hasattr(builder, "warnings") for line in builder.warnings()]


def main(hide_operator_status: bool = False, hide_errors_and_warnings: bool = False) -> None:
    """Print the report (upstream signature); ``hide_errors_and_warnings`` drops the ops' warning lines."""
    sys.stdout.write("-" * 60 + "\nDeepSpeed general environment info:\n")
    for label, value in environment_rows():
        sys.stdout.write(f"{label:.<22} {value}\n")
    if not hide_operator_status:
        sys.stdout.write("-" * 60 + "\nDeepSpeed op report (JIT builds cache in TORCH_EXTENSIONS_DIR):\n")
        _print_table(op_rows(), ("op name", "compatible", "built", "runs"))
    if not hide_errors_and_warnings:
        for line in _op_warnings():
            sys.stdout.write(f" [WARNING] {line}\n")
    sys.stdout.write("-" * 60 + "\n")


def cli_main() -> None:
    """Entry point of the ``ds_report`` / ``dsr`` console scripts."""
    parser = argparse.ArgumentParser(prog="ds_report", description="DeepSpeed environment and op report")
    parser.add_argument("--hide_operator_status", action="store_true", help="do not list the ops")
    parser.add_argument("--hide_errors_and_warnings", action="store_true", help="do not print the ops' warnings")
    args = parser.parse_args()
    main(hide_operator_status=args.hide_operator_status, hide_errors_and_warnings=args.hide_errors_and_warnings)


if __name__ == "__main__":
    cli_main()
