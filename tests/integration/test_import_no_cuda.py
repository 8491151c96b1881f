"""``import deepspeed`` must not create a CUDA context (vLLM and TRL import it in processes that fork or pick
their device later). On this CPU machine the check is that the import path calls nothing that would: in a fresh
interpreter every CUDA initialisation entry point is replaced by one that raises, then the package and the
submodules integrations import are imported. ``benchmarks/clients/cuda_import_check.py`` checks the same on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import torch, torch.cuda
def _refuse(*args, **kwargs):
    raise RuntimeError("CUDA initialised during import")
torch.cuda._lazy_init = torch.cuda.init = torch._C._cuda_init = _refuse
import deepspeed
import deepspeed.comm, deepspeed.accelerator, deepspeed.runtime.zero.stage3, deepspeed.runtime.zero.stage_1_and_2
from deepspeed.runtime.zero.partition_parameters import GatheredParameters
from deepspeed.utils import zero_to_fp32
print(deepspeed.__version__, deepspeed.DeepSpeedEngine.__name__, torch.cuda.is_initialized())
"""


@pytest.mark.parametrize("accelerator", ["auto", "cpu"])
def test_import_calls_no_cuda_initialisation(accelerator: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("DS_ACCELERATOR", None)
    if accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["DeepSpeedEngine", "False"], done.stdout


def test_probe_detects_an_initialising_import() -> None:
    # The probe itself must be able to fail: a module that touches CUDA at import is caught.
    bad = PROBE.replace("import deepspeed\n", "import deepspeed\ntorch.cuda._lazy_init()\n", 1)
    done = subprocess.run(
        [sys.executable, "-c", bad],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert done.returncode != 0 and "CUDA initialised during import" in done.stderr
