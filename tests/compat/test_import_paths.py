"""Import paths that integrations and scripts use (spec sections 1.1, 1.13, 1.14) resolve.

Each path is resolved the way ``from a.b import c`` / ``a.b.c`` does: the longest importable module
prefix, then attributes. The set of paths that do not resolve yet must equal ``EXPECTED_MISSING``, so
this test fails both when something regresses and when a missing path lands (then delete it from the
set). A module that exists but fails to import is an error, never "missing".
"""

from __future__ import annotations

import importlib

# Accelerate (src/accelerate/accelerator.py, utils/deepspeed.py, utils/dataclasses.py, tests).
ACCELERATE = [
    "deepspeed.DeepSpeedEngine",
    "deepspeed.comm",
    "deepspeed.comm.is_initialized",
    "deepspeed.runtime.lr_schedules.VALID_LR_SCHEDULES",
    "deepspeed.zero.GatheredParameters",
    "deepspeed.checkpoint.utils.clone_tensors_for_torch_save",
    "deepspeed.utils.set_z3_leaf_modules",
    "deepspeed.utils.groups._get_sequence_parallel_group",
    "deepspeed.utils.groups._get_sequence_parallel_world_size",
    "deepspeed.utils.groups._get_sequence_parallel_rank",
    "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF",
    "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPDataLoaderAdapter",
    "deepspeed.ops.adam.DeepSpeedCPUAdam",
    "deepspeed.ops.adam.FusedAdam",
    "deepspeed.ops.adagrad.DeepSpeedCPUAdagrad",
    "deepspeed.ops.lion.DeepSpeedCPULion",
    "deepspeed.launcher.runner.DEEPSPEED_ENVIRONMENT_NAME",
    "deepspeed.runtime.utils.move_to_device",
]

# Transformers (integrations/deepspeed.py, trainer.py).
TRANSFORMERS = [
    "deepspeed.zero.Init",
    "deepspeed.zero.GatheredParameters",
    "deepspeed.utils.logger",
    "deepspeed.utils.groups",
    "deepspeed.sequence.layer._SeqAllToAll",
]

# TRL (trl/models/utils.py).
TRL = [
    "deepspeed.__version__",
]

# Names the spec lists for deepspeed.utils / unpickling / direct construction (1.13, 5, 6.1, 7).
UTILITIES = [
    "deepspeed.utils.safe_get_full_fp32_param",
    "deepspeed.utils.safe_set_full_fp32_param",
    "deepspeed.utils.safe_get_full_optimizer_state",
    "deepspeed.utils.safe_set_full_optimizer_state",
    "deepspeed.utils.safe_get_full_grad",
    "deepspeed.utils.safe_set_full_grad",
    "deepspeed.utils.safe_get_local_fp32_param",
    "deepspeed.utils.safe_get_local_grad",
    "deepspeed.utils.safe_get_local_optimizer_state",
    "deepspeed.utils.safe_set_local_fp32_param",
    "deepspeed.utils.safe_set_local_optimizer_state",
    "deepspeed.utils.safe_update_full_grad_vectorized",
    "deepspeed.utils.tensor_fragment.safe_get_full_fp32_param",
    "deepspeed.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",
    "deepspeed.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict",
    "deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint",
    "deepspeed.utils.RepeatingLoader",
    "deepspeed.runtime.dataloader.RepeatingLoader",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer",
    "deepspeed.runtime.zero.utils.ZeRORuntimeException",
    "deepspeed.runtime.zero.utils.is_zero_supported_optimizer",
    "deepspeed.runtime.base_optimizer.DeepSpeedOptimizer",
    "deepspeed.runtime.base_optimizer.ZeROOptimizer",
    "deepspeed.runtime.utils.see_memory_usage",
    "deepspeed.runtime.utils.clip_grad_norm_",
    "deepspeed.runtime.activation_checkpointing.checkpointing.checkpoint",
    "deepspeed.runtime.config.DeepSpeedConfig",
    "deepspeed.runtime.engine.DeepSpeedEngine",
    "deepspeed.accelerator.get_accelerator",
    "deepspeed.env_report.main",
]

# Mixture of experts (Megatron-DeepSpeed and upstream's test helpers).
MOE = [
    "deepspeed.moe.layer.MoE",
    "deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer",
    "deepspeed.moe.utils.is_moe_param",
    "deepspeed.moe.utils.has_moe_layers",
    "deepspeed.moe.utils.split_params_grads_into_shared_and_expert_params",
    "deepspeed.moe.sharded_moe.TopKGate",
    "deepspeed.moe.sharded_moe.MOELayer",
    "deepspeed.moe.sharded_moe.top1gating",
    "deepspeed.moe.sharded_moe.top2gating",
    "deepspeed.moe.experts.Experts",
    "deepspeed.utils.groups._create_expert_and_data_parallel",
    "deepspeed.utils.groups._get_expert_parallel_group",
    "deepspeed.utils.groups._get_expert_data_parallel_group",
    "deepspeed.utils.groups._get_expert_parallel_world_size",
    "deepspeed.utils.groups._get_expert_parallel_rank",
    "deepspeed.utils.groups._get_expert_data_parallel_world_size",
    "deepspeed.utils.groups._get_expert_data_parallel_rank",
    "deepspeed.utils.groups._get_max_expert_size",
    "deepspeed.utils.groups._get_expert_parallel_group_dict",
]

# Top-level names (spec 1.1).
TOP_LEVEL = [
    f"deepspeed.{name}"
    for name in (
        "initialize",
        "init_distributed",
        "add_config_arguments",
        "init_inference",
        "default_inference_config",
        "tp_model_init",
        "zero",
        "checkpointing",
        "comm",
        "DeepSpeedEngine",
        "PipelineEngine",
        "PipelineModule",
        "DeepSpeedHybridEngine",
        "InferenceEngine",
        "DeepSpeedConfig",
        "DeepSpeedConfigError",
        "DeepSpeedOptimizer",
        "DeepSpeedDataLoader",
        "OnDevice",
        "log_dist",
        "logger",
        "get_accelerator",
        "ops",
        "module_inject",
        "DeepSpeedTransformerLayer",
        "DeepSpeedTransformerConfig",
        "add_tuning_arguments",
        "is_compile_supported",
        "HAS_TRITON",
        "__version__",
        "__version_major__",
        "__version_minor__",
        "__version_patch__",
        "__git_hash__",
        "__git_branch__",
        "version",
        "git_hash",
        "git_branch",
        "dist",
    )
]

ALL_PATHS = sorted(set(ACCELERATE + TRANSFORMERS + TRL + UTILITIES + MOE + TOP_LEVEL))

# Paths known not to resolve yet. Remove an entry when its feature lands (the test then tells you to).
EXPECTED_MISSING = frozenset(
    {
        # top-level / deepspeed.zero names not registered yet
        # features not implemented (spec section 7: later)
        "deepspeed.module_inject",
        "deepspeed.sequence.layer._SeqAllToAll",
        "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPAttentionHF",
        "deepspeed.runtime.sequence_parallel.ulysses_sp.UlyssesSPDataLoaderAdapter",
    }
)


def _is_missing_module(err: ImportError, module_name: str) -> bool:
    """True when ``err`` says ``module_name`` itself (or a parent package) does not exist."""
    name = getattr(err, "name", None)
    return isinstance(err, ModuleNotFoundError) and name is not None and module_name.startswith(name)


def resolve(path: str) -> bool:
    """Whether ``path`` resolves: import the longest existing module prefix, then follow attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ImportError as err:
            if _is_missing_module(err, module_name):
                continue
            raise
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_import_paths_resolve_except_the_documented_missing_ones() -> None:
    missing = {p for p in ALL_PATHS if not resolve(p)}
    newly_resolving = sorted(EXPECTED_MISSING - missing)
    newly_missing = sorted(missing - EXPECTED_MISSING)
    assert not newly_missing, f"import paths that stopped (or never started) resolving: {newly_missing}"
    assert not newly_resolving, f"these now resolve: remove them from EXPECTED_MISSING: {newly_resolving}"


def test_expected_missing_only_names_checked_paths() -> None:
    assert EXPECTED_MISSING <= set(ALL_PATHS), sorted(EXPECTED_MISSING - set(ALL_PATHS))


def test_resolver_can_fail() -> None:
    assert resolve("deepspeed.runtime.utils.move_to_device")
    assert not resolve("deepspeed.runtime.utils.no_such_helper")
    assert not resolve("deepspeed.no_such_module.x")
