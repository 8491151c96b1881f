"""deepspeed-lean: a memory-lean, DeepSpeed-compatible ZeRO training engine (temporary façade; wired up as modules land)."""
import os as _os

# Importing must never create a CUDA context.
_os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

from deepspeed.git_version_info import git_branch, git_hash, version  # noqa: E402
from deepspeed.utils.logging import log_dist, logger  # noqa: E402

__version__ = version
__git_hash__ = git_hash
__git_branch__ = git_branch
