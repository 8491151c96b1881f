"""Version and build identity, read by integrations as ``deepspeed.git_version_info``."""

from __future__ import annotations

from pathlib import Path

version: str = (Path(__file__).with_name("version.txt")).read_text().strip()
git_hash: str = "unknown"
git_branch: str = "unknown"
installed_ops: dict[str, bool] = {}
compatible_ops: dict[str, bool] = {}
torch_info: dict[str, str] = {"version": "0.0", "bf16_support": "False", "cuda_version": "0.0", "nccl_version": "0.0"}
