"""Import paths that integrations and scripts use (spec sections 1.1, 1.13, 1.14) resolve.

Each path is resolved the way ``from a.b import c`` / ``a.b.c`` does: the longest importable module
prefix, then attributes. The set of paths that do not resolve yet must equal ``EXPECTED_MISSING``, so
this test fails both when something regresses and when a missing path lands (then delete it from the
set). A module that exists but fails to import is an error, never "missing".
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

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

# Deep paths that RLHF and training frameworks import from upstream's runtime, checkpoint, utils and zero modules
# (docs/compat.md, "Internal paths third-party code imports"); behaviours are checked below.
THIRD_PARTY_DEEP_PATHS = [
    "deepspeed.runtime.bf16_optimizer.BF16_Optimizer",
    "deepspeed.runtime.fp16.fused_optimizer.FP16_Optimizer",
    "deepspeed.runtime.fp16.unfused_optimizer.FP16_UnfusedOptimizer",
    "deepspeed.runtime.zero.offload_config.OffloadDeviceEnum",
    "deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum",
    "deepspeed.checkpoint.utils.get_model_ckpt_name_for_rank",
    "deepspeed.checkpoint.utils.get_zero_ckpt_name_for_rank",
    "deepspeed.checkpoint.utils.get_layer_ckpt_name_for_rank",
    "deepspeed.checkpoint.utils.clone_tensors_for_torch_save",
    "deepspeed.runtime.zero.partition_parameters.MultipleAllGatherHandles",
    "deepspeed.runtime.engine.MEMORY_OPT_ALLREDUCE_SIZE",
    "deepspeed.sequence.layer.DistributedAttention",
    "deepspeed.sequence.layer.single_all_to_all",
    "deepspeed.sequence.layer.uneven_heads_all2all",
    "deepspeed.runtime.pipe.topology.PipeModelDataParallelTopology",
    "deepspeed.runtime.pipe.topology.ProcessTopology",
    "deepspeed.runtime.config.DeepSpeedConfig._configure_train_batch_size",
    "deepspeed.runtime.zero.partition_parameters.ZeroParamStatus",
    "deepspeed.runtime.zero.partition_parameters.zero_wrapper_for_fp_tensor_constructor",
    "deepspeed.runtime.zero.partition_parameters._orig_torch_arange",
    "deepspeed.runtime.zero.GatheredParameters",
    "deepspeed.runtime.engine.DeepSpeedEngine",
    "deepspeed.runtime.engine.autocast_if_enabled",
    "deepspeed.runtime.engine.DeepSpeedEngine.print_forward_breakdown",
    "deepspeed.runtime.checkpoint_engine.TorchCheckpointEngine",
    "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine.TorchCheckpointEngine",
    "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer",
    "deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3",
    "deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload",
    "deepspeed.runtime.zero.utils.get_mapping_to_flat_buffer",
    "deepspeed.runtime.zero.utils.ZERO_SUPPORTED_OPTIMIZERS",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.fp16.loss_scaler.INITIAL_LOSS_SCALE",
    "deepspeed.runtime.fp16.loss_scaler.SCALE_WINDOW",
    "deepspeed.runtime.fp16.loss_scaler.MIN_LOSS_SCALE",
    "deepspeed.runtime.utils.see_memory_usage",
    "deepspeed.runtime.utils.move_to_device",
    "deepspeed.runtime.utils.clip_grad_norm_",
    "deepspeed.runtime.utils.get_global_norm",
    "deepspeed.runtime.activation_checkpointing.checkpointing",
    "deepspeed.runtime.pipe.engine.PipelineEngine",
    "deepspeed.runtime.pipe.schedule.TrainSchedule",
    "deepspeed.runtime.pipe.schedule.InferenceSchedule",
    "deepspeed.pipe.PipelineModule",
    "deepspeed.pipe.LayerSpec",
    "deepspeed.pipe.TiedLayerSpec",
    "deepspeed.runtime.dataloader.RepeatingLoader",
    "deepspeed.checkpoint.UNIVERSAL_CHECKPOINT_INFO",
    "deepspeed.checkpoint.ORIGINAL_VOCAB_SIZE",
    "deepspeed.checkpoint.PADDED_VOCAB_SIZE",
    "deepspeed.checkpoint.constants.OPTIMIZER_STATE_DICT",
    "deepspeed.utils.logger",
    "deepspeed.utils.log_dist",
    "deepspeed.utils.safe_get_full_fp32_param",
    "deepspeed.utils.safe_get_full_grad",
    "deepspeed.utils.set_z3_leaf_modules",
    "deepspeed.utils.instrument_w_nvtx",
    "deepspeed.utils.logging.print_dist",
    "deepspeed.git_version_info.installed_ops",
    "deepspeed.git_version_info.torch_info",
    "deepspeed.env_report.main",
    "deepspeed.launcher.runner.main",
    # Timers, monitors and the FLOPs profiler (Megatron-DeepSpeed, GPT-NeoX, training loops, LLaMA-Factory).
    "deepspeed.utils.timer.ThroughputTimer",
    "deepspeed.utils.timer.SynchronizedWallClockTimer",
    "deepspeed.utils.timer.NoopTimer",
    "deepspeed.utils.timer.FORWARD_GLOBAL_TIMER",
    "deepspeed.utils.timer.STEP_GLOBAL_TIMER",
    "deepspeed.utils.config.get_timers_config",
    "deepspeed.monitor.monitor.MonitorMaster",
    "deepspeed.monitor.monitor.Monitor",
    "deepspeed.monitor.tensorboard.TensorBoardMonitor",
    "deepspeed.monitor.wandb.WandbMonitor",
    "deepspeed.monitor.csv_monitor.csvMonitor",
    "deepspeed.monitor.comet.CometMonitor",
    "deepspeed.monitor.config.get_monitor_config",
    "deepspeed.profiling.flops_profiler.FlopsProfiler",
    "deepspeed.profiling.flops_profiler.get_model_profile",
    "deepspeed.profiling.flops_profiler.profiler.FlopsProfiler",
    "deepspeed.runtime.engine.DeepSpeedEngine.get_wall_clock_timers",
]

ALL_PATHS = sorted(set(ACCELERATE + TRANSFORMERS + TRL + UTILITIES + MOE + TOP_LEVEL + THIRD_PARTY_DEEP_PATHS))

# Paths known not to resolve yet. Remove an entry when its feature lands (the test then tells you to).
EXPECTED_MISSING = frozenset(
    {
        # top-level / deepspeed.zero names not registered yet
        # features not implemented (spec section 7: later)
        "deepspeed.module_inject",
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


# ---------------------------------------------------------------------- behaviours behind the deep paths
def test_checkpoint_name_helpers_return_upstreams_file_names() -> None:
    from deepspeed.checkpoint import utils

    assert utils.get_model_ckpt_name_for_rank("ck/t", "00") == os.path.join("ck/t", "mp_rank_00_model_states.pt")
    assert utils.get_zero_ckpt_name_for_rank("ck/t", 3, 1) == os.path.join(
        "ck/t", "zero_pp_rank_3_mp_rank_01_optim_states.pt"
    )
    assert utils.get_layer_ckpt_name_for_rank("ck/t", "layer_07", 2) == os.path.join(
        "ck/t", "layer_07-model_02_model_states.pt"
    )


def test_checkpoint_package_exposes_the_key_constants() -> None:
    import deepspeed.checkpoint as ckpt

    assert ckpt.UNIVERSAL_CHECKPOINT_INFO == "universal_checkpoint_info"
    assert (ckpt.PADDED_VOCAB_SIZE, ckpt.ORIGINAL_VOCAB_SIZE) == ("padded_vocab_size", "original_vocab_size")


def test_engine_module_constants_and_autocast_context() -> None:
    from deepspeed.runtime import engine

    assert engine.MEMORY_OPT_ALLREDUCE_SIZE == 500000000
    marker = object()
    with engine.autocast_if_enabled(marker) as entered:  # type: ignore[arg-type]
        assert entered is marker and not torch.is_autocast_enabled()


def test_pipe_model_data_parallel_topology_coordinates() -> None:
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=3)
    assert topo.get_axis_names() == ["pipe", "data", "model"] and topo.world_size() == 12
    # Axis order pipe, data, model: the model axis varies fastest, the pipe axis slowest.
    coord = topo.get_coord(7)
    assert (coord.pipe, coord.data, coord.model) == (1, 0, 1)
    assert topo.get_rank(pipe=1, data=2, model=0) == 10


def test_configure_train_batch_size_derives_and_asserts() -> None:
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = DeepSpeedConfig({"train_batch_size": 4})
    cfg.world_size = 2
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = None, 3, 2
    cfg._configure_train_batch_size()
    assert (cfg.train_batch_size, cfg.plan.batch.dp_world_size) == (12, 2)
    cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps = 10, 3, 2
    with pytest.raises(AssertionError, match="10 != 3 \\* 2 \\* 2"):
        cfg._configure_train_batch_size()


def test_multiple_all_gather_handles_wait_on_each() -> None:
    from deepspeed.runtime.zero.partition_parameters import MultipleAllGatherHandles

    waited: list[int] = []

    class Handle:
        def __init__(self, i: int) -> None:
            self.i = i

        def wait(self) -> None:
            waited.append(self.i)

    MultipleAllGatherHandles([Handle(0), Handle(1), Handle(2)]).wait(handle_dependency=True)
    assert waited == [0, 1, 2]


def test_flat_buffer_mapping_and_nvtx_decorator() -> None:
    from deepspeed.runtime.zero.utils import get_mapping_to_flat_buffer
    from deepspeed.utils import instrument_w_nvtx

    a, b = torch.zeros(2, 3), torch.zeros(5)
    assert [(t is x, off, n) for (t, off, n), x in zip(get_mapping_to_flat_buffer([a, b]), (a, b), strict=True)] == [
        (True, 0, 6),
        (True, 6, 5),
    ]
    assert instrument_w_nvtx(lambda x: x + 1)(1) == 2


def test_print_dist_prints_on_the_selected_ranks(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    from deepspeed.utils.logging import print_dist

    monkeypatch.setenv("RANK", "1")
    print_dist("hello", ranks=[0])
    print_dist("world", ranks=[1])
    assert capsys.readouterr().out == "[Rank 1] world\n"


def test_torch_checkpoint_engine_round_trip(tmp_path) -> None:
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    engine = TorchCheckpointEngine()
    engine.makedirs(str(tmp_path / "tag"), exist_ok=True)
    path = str(tmp_path / "tag" / "mp_rank_00_model_states.pt")
    engine.save({"w": torch.arange(4.0)}, path)
    assert torch.equal(engine.load(path)["w"], torch.arange(4.0)) and engine.commit("tag")


def _wrapper_kinds(config: dict) -> dict:
    import deepspeed
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
    engine, *_ = deepspeed.initialize(
        model=torch.nn.Linear(4, 4), config={"train_micro_batch_size_per_gpu": 1, "optimizer": optimizer, **config}
    )
    kinds = {
        name: isinstance(engine.optimizer, cls)
        for name, cls in (
            ("bf16", BF16_Optimizer),
            ("fused", FP16_Optimizer),
            ("unfused", FP16_UnfusedOptimizer),
            ("zero", DeepSpeedZeroOptimizer),
            ("base", DeepSpeedOptimizer),
        )
    }
    engine.destroy()
    return kinds


WRAPPER_CASES = [
    # (config, the upstream wrappers whose isinstance holds besides DeepSpeedOptimizer)
    ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}, "data_types": {"grad_accum_dtype": "fp32"}},
     {"bf16", "zero"}),
    ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}, {"zero"}),
    ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}, "data_types": {"grad_accum_dtype": "fp32"}},
     {"zero"}),
    ({"bf16": {"enabled": True}}, {"unfused"}),
    ({"fp16": {"enabled": True}}, {"unfused"}),
    ({}, set()),
]  # fmt: skip


def test_engine_optimizer_is_an_instance_of_the_wrapper_upstream_would_choose() -> None:
    from tests._harness import run_distributed

    for config, expected in WRAPPER_CASES:
        (kinds,) = run_distributed(_wrapper_kinds, 1, config)
        assert kinds.pop("base"), config
        assert {name for name, held in kinds.items() if held} == expected, config


def test_wrappers_refuse_construction_naming_the_alternative() -> None:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    for cls in (BF16_Optimizer, FP16_Optimizer, FP16_UnfusedOptimizer):
        with pytest.raises(NotImplementedError, match=f"{cls.__name__} is not constructed directly.*initialize"):
            cls(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    assert not isinstance(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), BF16_Optimizer)
