"""deepspeed-lean: a memory-lean, drop-in DeepSpeed-compatible ZeRO training engine.

The public surface (``initialize``, ``init_distributed``, ``add_config_arguments``, ``zero``, ``comm``,
version attributes) matches upstream DeepSpeed; the implementation lives in ``deepspeed._core``.
"""

import os as _os

# Importing must never create a CUDA context (NVML answers device queries instead).
_os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import importlib as _importlib
from collections.abc import Callable as _Callable
from typing import Any

from packaging import version as _pkg_version

from deepspeed.git_version_info import git_branch, git_hash, version
from deepspeed.utils.logging import log_dist, logger

# Heavy names resolve on first access (PEP 562), so `import deepspeed` stays cheap for the launcher,
# whose processes never need torch. Each entry: public name -> (module, attribute or None for the module).
_LAZY = {
    "comm": ("deepspeed.comm", None),
    "init_distributed": ("deepspeed.comm", "init_distributed"),
    "get_accelerator": ("deepspeed.accelerator", "get_accelerator"),
    "DeepSpeedConfig": ("deepspeed.runtime.config", "DeepSpeedConfig"),
    "DeepSpeedConfigError": ("deepspeed.runtime.config", "DeepSpeedConfigError"),
    "DeepSpeedEngine": ("deepspeed.runtime.engine", "DeepSpeedEngine"),
    "DeepSpeedOptimizer": ("deepspeed._core.optim.base", "EngineOptimizer"),
    "DeepSpeedDataLoader": ("deepspeed.runtime.dataloader", "DeepSpeedDataLoader"),
    "runtime": ("deepspeed.runtime.lr_schedules", "__package__"),
    "ops": ("deepspeed.ops", None),
    "accelerator": ("deepspeed.accelerator", None),
    "utils": ("deepspeed.utils", None),
    "checkpoint": ("deepspeed.checkpoint", None),
    "launcher": ("deepspeed.launcher", None),
    "zero": ("deepspeed.runtime.zero", None),
    "checkpointing": ("deepspeed.runtime.activation_checkpointing.checkpointing", None),
    "add_tuning_arguments": ("deepspeed.runtime.lr_schedules", "add_tuning_arguments"),
    "OnDevice": ("deepspeed.utils.init_on_device", "OnDevice"),
    "init_inference": ("deepspeed.unsupported", "init_inference"),
    "default_inference_config": ("deepspeed.unsupported", "default_inference_config"),
    "tp_model_init": ("deepspeed.unsupported", "tp_model_init"),
    "PipelineEngine": ("deepspeed.runtime.pipe.engine", "PipelineEngine"),
    "PipelineModule": ("deepspeed.runtime.pipe.module", "PipelineModule"),
    "InferenceEngine": ("deepspeed.unsupported", "InferenceEngine"),
    "DeepSpeedHybridEngine": ("deepspeed.unsupported", "DeepSpeedHybridEngine"),
    "DeepSpeedTransformerLayer": ("deepspeed.unsupported", "DeepSpeedTransformerLayer"),
    "DeepSpeedTransformerConfig": ("deepspeed.unsupported", "DeepSpeedTransformerConfig"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'deepspeed' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = _importlib.import_module(module_name)
    if attr == "__package__":  # `deepspeed.runtime` with lr_schedules already imported, as accelerate expects
        value = _importlib.import_module(module_name.rpartition(".")[0])
    else:
        value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = version


def is_compile_supported() -> bool:
    """True when this torch has ``torch.compile`` (what ``engine.compile`` uses)."""
    import torch

    return hasattr(torch, "compile")


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


HAS_TRITON = _has_triton()
__git_hash__ = git_hash
__git_branch__ = git_branch
_parsed = _pkg_version.parse(__version__)
__version_major__, __version_minor__, __version_patch__ = _parsed.major, _parsed.minor, _parsed.micro

# Set to ``deepspeed.comm`` by ``initialize`` (upstream contract).
dist = None


def _resolve_config(args: Any, config: Any, config_params: Any) -> Any:
    """Pick the config source exactly as upstream does (``config`` / ``config_params`` / ``args``)."""
    if config is None and config_params is not None:
        config = config_params
    if args is not None and getattr(args, "deepscale_config", None) is not None:
        logger.warning("--deepscale_config is deprecated, use --deepspeed_config")
        if getattr(args, "deepspeed_config", None) is None:
            args.deepspeed_config = args.deepscale_config
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None and config is not None:
        raise AssertionError(
            "Not sure how to proceed, we were given deepspeed configs in the deepspeed arguments and "
            "deepspeed.initialize() function call"
        )
    config = config if config is not None else from_args
    if config is None:
        raise AssertionError("DeepSpeed requires --deepspeed_config to specify configuration file")
    return config


def initialize(
    args: Any = None,
    model: Any = None,
    optimizer: Any = None,
    model_parameters: Any = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: Any = None,
    collate_fn: Any = None,
    config: Any = None,
    mesh_param: Any = None,
    config_params: Any = None,
) -> tuple:
    """Wrap ``model`` for training and return ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    Args:
        args: an argparse namespace; ``args.deepspeed_config`` may name the config, ``args.local_rank``
            is checked against and overwritten by the launcher's ``LOCAL_RANK``.
        model: the ``torch.nn.Module`` to train (required).
        optimizer: a torch optimizer, or a callable taking the parameters and returning one.
        model_parameters: parameters (or parameter groups) to optimize; default all of ``model``'s.
        training_data: a dataset; when given, a distributed data loader of micro-batches is returned.
        lr_scheduler: a scheduler, or a callable taking the inner optimizer and returning one.
        distributed_port: master port when the process group still has to be created.
        mpu: model-parallel unit (``get_data_parallel_group`` etc.).
        dist_init_required: ``False`` forbids creating a process group here.
        collate_fn: collate function of the returned data loader.
        config: dict, JSON/hjson file path, or base64 JSON string; ``config_params`` is an alias.
        mesh_param: accepted for signature compatibility (device meshes are not supported yet).
    """
    if model is None:
        raise AssertionError("deepspeed.initialize requires a model")
    if mesh_param is not None:
        raise NotImplementedError("mesh_param (sequence-parallel device meshes) is not supported by deepspeed-lean yet")
    from deepspeed import comm
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.engine import DeepSpeedEngine

    global dist
    dist = comm
    config = _resolve_config(args, config, config_params)
    comm.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        distributed_port=distributed_port,
        dist_init_required=dist_init_required,
    )
    # PipelineEngine takes its own leading argument, so the two classes share a call, not a constructor type.
    engine_class: _Callable[..., DeepSpeedEngine] = DeepSpeedEngine
    from deepspeed.runtime.pipe.module import PipelineModule

    if isinstance(model, PipelineModule):  # upstream's dispatch: the model's own grid is the mpu
        if mpu is not None:
            raise AssertionError("mpu must be None with pipeline parallelism: the PipelineModule's grid is used")
        from deepspeed.runtime.pipe.engine import PipelineEngine

        engine_class, mpu = PipelineEngine, model.mpu()
    engine = engine_class(
        args=args,
        model=model,
        optimizer=optimizer,
        model_parameters=model_parameters,
        training_data=training_data,
        lr_scheduler=lr_scheduler,
        mpu=mpu,
        dist_init_required=dist_init_required,
        collate_fn=collate_fn,
        config=config,
    )
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def add_config_arguments(parser: Any) -> Any:
    """Add the ``DeepSpeed`` argument group (``--deepspeed``, ``--deepspeed_config``) to ``parser``."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true", help="Enable DeepSpeed")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true", help="Deprecated alias of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated alias of --deepspeed_config")
    return parser


__all__ = [
    "initialize",
    "init_distributed",
    "add_config_arguments",
    "comm",
    "DeepSpeedEngine",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "get_accelerator",
    "log_dist",
    "logger",
    "__version__",
]
