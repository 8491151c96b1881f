"""After ``import deepspeed`` (and the submodules integrations import), no CUDA context exists.

    python benchmarks/clients/cuda_import_check.py --out OUT            # on a CUDA machine
    python benchmarks/clients/cuda_import_check.py --out OUT --smoke    # anywhere: the same check, CPU allowed

vLLM and TRL import DeepSpeed in processes that fork or choose their device later; a context created at import
would pin them to device 0 or break the fork. The check runs in a fresh interpreter with the accelerator left to
auto-detection and writes one JSON record to ``OUT/cuda_import_check.jsonl``: ``torch.cuda.is_initialized()``
after the imports, the accelerator DeepSpeed picked, device count, versions. Exit status 1 when a context exists
(or, without ``--smoke``, when no CUDA device is visible).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROBE = """
import json, torch
import deepspeed
import deepspeed.comm, deepspeed.runtime.zero.stage3, deepspeed.runtime.zero.stage_1_and_2
from deepspeed.runtime.zero.partition_parameters import GatheredParameters
from deepspeed.accelerator import get_accelerator
initialized_after_import = torch.cuda.is_initialized()
accelerator = get_accelerator().device_name()
initialized_after_accelerator = torch.cuda.is_initialized()
print("RECORD " + json.dumps({"initialized_after_import": initialized_after_import,
    "initialized_after_get_accelerator": initialized_after_accelerator, "accelerator": accelerator,
    "cuda_available": torch.cuda.is_available(), "device_count": torch.cuda.device_count(),
    "initialized_after_device_count": torch.cuda.is_initialized(), "torch": torch.__version__,
    "deepspeed": deepspeed.__version__, "deepspeed_file": deepspeed.__file__}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RECORD ")]
    record = json.loads(lines[-1][7:]) if lines else {"error": (done.stdout + done.stderr)[-4000:]}
    record["mode"] = "smoke" if args.smoke else "gpu"
    record["ok"] = (
        bool(lines)
        and not record["initialized_after_import"]
        and not record["initialized_after_get_accelerator"]
        and (args.smoke or record["cuda_available"])
    )
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "cuda_import_check.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record))
    sys.exit(0 if record["ok"] else 1)


if __name__ == "__main__":
    main()
