"""Shared pieces of the HF Trainer / accelerate integration tests.

The tiny GPT-2 and the synthetic data set come from ``examples/hf_trainer.py`` so the tests exercise the example.
Everything here is importable without transformers/accelerate; the test modules skip (with the reason from
:func:`missing_integration_packages`) when those are not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples"
HF_SCRIPT = EXAMPLES / "hf_trainer.py"
ZERO2_AUTO = EXAMPLES / "ds_config_zero2_auto.json"
ZERO3_AUTO = EXAMPLES / "ds_config_zero3_auto.json"
SUMMARY_PREFIX = "LEAN_SUMMARY "
# Environment for every process these tests start: CPU accelerator, no network, quiet tokenizers.
QUIET_ENV = {
    "DS_ACCELERATOR": "cpu",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "OMP_NUM_THREADS": "1",
}


def missing_integration_packages() -> str | None:
    """Why the integration tests cannot run here (``None`` when transformers and accelerate are importable)."""
    missing = [name for name in ("transformers", "accelerate") if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (
        f"{' and '.join(missing)} not installed: install the integration extra "
        "(pip install -e '.[test]') to run the HF Trainer / accelerate tests"
    )


def load_example() -> ModuleType:
    """Import ``examples/hf_trainer.py`` as a module (examples are scripts, not a package)."""
    name = "_lean_example_hf_trainer"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HF_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_launcher(script_args: list[str], timeout: float = 240.0, num_gpus: int = 2) -> tuple[dict, str]:
    """Run ``deepspeed --num_gpus N examples/hf_trainer.py ARGS`` and return (rank 0's summary, output).

    Raises:
        AssertionError: the job failed or printed no summary (the output is in the message).
    """
    env = dict(os.environ, **QUIET_ENV)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH", "")]))
    launcher = [sys.executable, "-m", "deepspeed.launcher.runner"]
    cmd = [*launcher, "--num_gpus", str(num_gpus), "--master_port", str(_free_port()), str(HF_SCRIPT), *script_args]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    tail = output[-6000:]
    assert proc.returncode == 0, f"launcher exited with {proc.returncode}; command {cmd}\n{tail}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith(SUMMARY_PREFIX)]
    assert len(lines) == 1, f"expected one summary line from rank 0, got {len(lines)}\n{tail}"
    return json.loads(lines[0][len(SUMMARY_PREFIX) :]), output


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def losses_by_step(summary: dict[str, Any]) -> dict[int, float]:
    """``{global_step: logged loss}`` from a run summary."""
    return {int(step): float(loss) for step, loss in summary["losses"]}
