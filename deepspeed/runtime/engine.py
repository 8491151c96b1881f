"""``DeepSpeedEngine``: upstream's engine API over the private training loop in ``deepspeed._core.engine``.

Construction is one ordered list of ``_apply_*`` steps (config → process group → device → module →
optimizer → scheduler → data loader); the training methods delegate to :class:`TrainingLoop`, and the
many upstream getters read the validated config.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from deepspeed import comm as dist
from deepspeed._core.engine import sequence_layout, setup
from deepspeed._core.engine.activation_checkpoint import cpu_checkpointing_problem
from deepspeed._core.engine.state_offload import StateOffloader, parse_kinds
from deepspeed._core.engine.training import TrainingLoop
from deepspeed._core.moe.params import configure_moe_param_groups, moe_layers
from deepspeed._core.observe.flops import FlopsProfiler
from deepspeed._core.observe.preflight import check_outputs
from deepspeed._core.optim.base import EngineOptimizer
from deepspeed._core.optim.loss_scaling import from_policy as loss_scaler_from_policy
from deepspeed._core.optim.stage3 import Stage3Optimizer
from deepspeed.moe._setup import configure_moe
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
from deepspeed.runtime.dataloader import DeepSpeedDataLoader
from deepspeed.runtime.engine_checkpointing import EngineCheckpointMixin
from deepspeed.runtime.optimizers import build_basic_optimizer, build_lr_scheduler
from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
from deepspeed.runtime.zero.partition_parameters import GatheredParameters
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
from deepspeed.tools.profiling.memory_timeline import TimelineAnalyser
from deepspeed.utils.logging import log_dist


class DeepSpeedEngine(EngineCheckpointMixin, torch.nn.Module):
    """Wraps a model for distributed, mixed-precision, ZeRO-partitioned training.

    Users normally get one from :func:`deepspeed.initialize`. Unknown attributes fall through to the
    wrapped ``module``.
    """

    _is_pipeline_engine = False  # PipelineEngine sets it; the 'pipeline' config block is refused otherwise

    def __init__(
        self,
        args: Any,
        model: torch.nn.Module,
        optimizer: Any = None,
        model_parameters: Any = None,
        training_data: Any = None,
        lr_scheduler: Any = None,
        mpu: Any = None,
        dist_init_required: bool | None = None,
        collate_fn: Any = None,
        config: Any = None,
        config_class: DeepSpeedConfig | None = None,
        mesh_device: Any = None,
        dont_change_device: bool = False,
    ) -> None:
        super().__init__()
        self.module = model
        self.mpu = mpu
        self.client_model_parameters = model_parameters
        self._apply_config(args, config, config_class, mpu)
        self._apply_process_group(dist_init_required)
        self._apply_moe()
        self._apply_device(args, dont_change_device)
        self._apply_optimizer(optimizer, model_parameters)
        self._apply_scheduler(lr_scheduler)
        self._loop = TrainingLoop(
            self.module, self._stepped_optimizer, self.lr_scheduler, self.plan, TimelineAnalyser()
        )
        self._apply_flops_profiler()
        self.training_dataloader = self._build_dataloader(training_data, collate_fn) if training_data else None
        zenflow = getattr(self._stepped_optimizer, "zenflow", None)
        if zenflow is not None and self.training_dataloader is not None:  # select_strategy "epoch"
            zenflow.use_epoch_length(len(self.training_dataloader) // max(1, self.gradient_accumulation_steps()))
        self._loop.memory.report("after initialize")
        log_dist(
            f"DeepSpeedEngine ready: stage={self.zero_optimization_stage()} dtype={self.plan.precision.param_dtype} "
            f"dp_world_size={self.dp_world_size} gas={self.gradient_accumulation_steps()}",
            ranks=[0],
        )

    # --- set-up steps, in order ------------------------------------------------------------------
    def _apply_config(self, args: Any, config: Any, config_class: DeepSpeedConfig | None, mpu: Any) -> None:
        if config_class is None:
            if config is None:
                config = getattr(args, "deepspeed_config", None)
            config_class = DeepSpeedConfig(config, mpu)
        self._config = config_class
        self.config = config_class._param_dict
        self.plan = config_class.plan
        if config_class.comms_config.comms_logger_enabled:
            dist.configure(config_class)  # the comms_logger block takes effect for this process's collectives
        if "pipeline" in self.config and not self._is_pipeline_engine:
            raise DeepSpeedConfigError(
                f"the config sets 'pipeline' but the model is a {type(self.module).__name__}, not a PipelineModule: "
                "pipeline settings only apply to deepspeed.pipe.PipelineModule models; remove the 'pipeline' block"
            )
        self.sequence_parallel_size = sequence_layout.requested_size(self.config, mpu)
        sequence_layout.check_pipeline(self.sequence_parallel_size, self._is_pipeline_engine)
        self.plan = sequence_layout.with_sequence_parallel_comm_dtype(
            self.plan,
            self.sequence_parallel_size,
            config_class.seq_parallel_communication_data_type,
            key_given="seq_parallel_communication_data_type" in self.config,
        )
        if config_class.activation_checkpointing_config.cpu_checkpointing:
            problem = cpu_checkpointing_problem(self.module)
            if problem is not None:
                raise DeepSpeedConfigError(problem)
        check_outputs(self.plan)  # every rank, before the first collective: a bad monitor path fails everywhere

    def _apply_process_group(self, dist_init_required: bool | None) -> None:
        if not dist.is_initialized():
            if dist_init_required is False:
                raise RuntimeError("dist_init_required=False but no process group is initialized")
            from deepspeed.accelerator import get_accelerator

            dist.init_distributed(dist_backend=get_accelerator().communication_backend_name())
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if self.sequence_parallel_size > 1:
            self._apply_sequence_parallel()
            return
        self.dp_group = self.mpu.get_data_parallel_group() if self.mpu is not None else None
        self.dp_world_size = dist.get_world_size(group=self.dp_group)
        self.mp_world_size = self.mpu.get_model_parallel_world_size() if self.mpu is not None else 1
        self.seq_parallel_group = None
        self.seq_data_parallel_group, self.seq_dp_world_size = self.dp_group, self.dp_world_size
        self._data_rank = dist.get_rank(group=self.dp_group)

    def _apply_sequence_parallel(self) -> None:
        # ZeRO shards and averages over every rank; data and the batch arithmetic see world / SP replicas
        # (deepspeed._core.engine.sequence_layout says why the average is exact).
        from deepspeed.utils import groups

        layout, self.mpu = sequence_layout.build(self.sequence_parallel_size, self.mpu)
        groups.mpu = self.mpu  # deepspeed.utils.groups' SP queries (accelerate's loader adapter) answer from it
        self.seq_parallel_group = layout.seq_parallel_group
        self.seq_data_parallel_group = self.dp_group = layout.zero_group
        self.seq_dp_world_size = layout.zero_world_size
        self.dp_world_size = layout.data_world_size
        self._data_rank = layout.data_rank
        self.mp_world_size = 1

    def _apply_moe(self) -> None:
        # Expert groups exist before any optimizer: their gradients reduce over expert-data-parallel groups.
        self.expert_groups = configure_moe(
            self.module,
            self.zero_optimization_stage(),
            self.mpu,
            bool(self.config.get("use_data_before_expert_parallelism", False)),
        )
        self.has_moe_layers = bool(self.expert_groups)
        self.moe_layers = moe_layers(self.module)
        self.num_experts = [layer.num_experts for layer in self.moe_layers]

    def _apply_device(self, args: Any, dont_change_device: bool) -> None:
        self.local_rank = setup.local_rank_from_env()
        arg_rank = getattr(args, "local_rank", None)
        if isinstance(arg_rank, int) and arg_rank >= 0 and arg_rank != self.local_rank:
            raise ValueError(
                f"args.local_rank={arg_rank} does not match the LOCAL_RANK environment variable ({self.local_rank})"
            )
        if args is not None and hasattr(args, "local_rank"):
            args.local_rank = self.local_rank
        self.device = setup.resolve_device(self.local_rank)
        setup.prepare_module(self.module, self.plan, None if dont_change_device else self.device)
        self.zero3_manager = None
        if self.zero_optimization_stage() == 3:
            self.zero3_manager = setup.partition_parameters(
                self.module, self.plan, self.dp_group, None if dont_change_device else self.device
            )

    def _apply_optimizer(self, client_optimizer: Any, model_parameters: Any) -> None:
        params: list[Any] = list(model_parameters) if model_parameters is not None else list(self.module.parameters())
        if self.has_moe_layers and not isinstance(client_optimizer, torch.optim.Optimizer):
            params = configure_moe_param_groups(params)  # the optimizer is built here: give experts groups
        self.basic_optimizer = build_basic_optimizer(client_optimizer, params, self._config, self.module)
        self.optimizer: EngineOptimizer | DeepSpeedZeRoOffload | None = None
        if self.basic_optimizer is None:
            if self.zero3_manager is not None:  # ZeRO-3 inference: only the parameter manager
                self.optimizer = DeepSpeedZeRoOffload.from_manager(self.zero3_manager, self.dp_group)
                return
            if self.zero_optimization_stage() in (1, 2):
                raise ValueError(
                    f"ZeRO stage {self.zero_optimization_stage()} requires an optimizer: pass one to "
                    "deepspeed.initialize or add an 'optimizer' block to the config"
                )
            return
        setup.check_trainable(self.module, [p for g in self.basic_optimizer.param_groups for p in g["params"]])
        loss_scaler = None
        if self.plan.precision.loss_scale is not None:
            loss_scaler = loss_scaler_from_policy(self.plan.precision.loss_scale)
        optimizer = setup.wrap_optimizer(
            self.basic_optimizer,
            self.plan,
            loss_scaler,
            self.dp_group,
            self.seq_dp_world_size,
            self.module,
            self.zero3_manager,
            zero12_factory=DeepSpeedZeroOptimizer.from_plan,
            expert_groups=self.expert_groups,
        )
        if isinstance(optimizer, Stage3Optimizer) and self.zero3_manager is not None:  # both hold under stage 3
            optimizer.parameter_offload = DeepSpeedZeRoOffload.from_manager(self.zero3_manager, self.dp_group)
        self.optimizer = optimizer

    @property
    def _stepped_optimizer(self) -> EngineOptimizer | None:
        # ZeRO-3 inference sets ``optimizer`` to the parameter manager's view (upstream's attribute there), which
        # has no step, gradients or parameter groups: the loop and the optimizer queries see no optimizer then.
        return self.optimizer if isinstance(self.optimizer, EngineOptimizer) else None

    def _apply_scheduler(self, client_scheduler: Any) -> None:
        self.lr_scheduler = build_lr_scheduler(client_scheduler, self.basic_optimizer, self._config)

    def _apply_flops_profiler(self) -> None:
        # Upstream profiles on global rank 0 only; the other ranks keep None.
        profile = self.plan.flops_profiler
        if profile.enabled and self.global_rank == 0:
            self.flops_profiler: FlopsProfiler | None = FlopsProfiler(
                self.module, ds_engine=self, recompute_fwd_factor=profile.recompute_fwd_factor
            )
            self._loop.observer.profiler = self.flops_profiler
        else:
            self.flops_profiler = None

    def _build_dataloader(self, dataset: Any, collate_fn: Any) -> DeepSpeedDataLoader:
        return DeepSpeedDataLoader(
            dataset,
            batch_size=self.train_micro_batch_size_per_gpu(),
            pin_memory=False,
            local_rank=self.local_rank,
            tput_timer=None,
            collate_fn=collate_fn,
            data_parallel_world_size=self.dp_world_size,
            data_parallel_rank=self._data_rank,
            dataloader_drop_last=self.plan.dataloader_drop_last,
        )

    # --- attribute fall-through ------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            return getattr(module, name)

    # --- training ---------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module's forward."""
        return self._loop.forward(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate ``loss``; gradients are divided by the accumulation steps when ``scale_wrt_gas``."""
        return self._loop.backward(loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Scale ``loss`` for a caller-run ``loss.backward()`` (accumulation and fp16 loss scale)."""
        return self._loop.scale(loss)

    def step(self, lr_kwargs: dict | None = None) -> None:
        """End a micro-step; at the accumulation boundary apply the optimizer and scheduler."""
        self._loop.step(lr_kwargs)

    # Upstream's engine narrows nn.Module.zero_grad to no arguments; tests/compat pins that signature.
    def zero_grad(self) -> None:  # type: ignore[override]
        """Drop the gradients of the model's parameters."""
        self._loop.zero_grad()

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the current micro-step ends an accumulation window."""
        return self._loop.accumulation.is_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Force whether the current micro-step is a boundary (accelerate drives accumulation this way)."""
        self._loop.accumulation.set_boundary(is_boundary)

    def no_sync(self) -> Any:
        """Context in which backwards skip gradient reduction (ZeRO stage 0/1 only)."""
        return self._loop.no_sync(self.zero_optimization_stage())

    def was_step_applied(self) -> bool:
        """True when the last ``step()`` updated the weights (False on overflow or mid-window)."""
        return self._loop.step_applied

    def get_global_grad_norm(self) -> float | None:
        """Global gradient norm of the last applied step (``None`` before the first step)."""
        optimizer = self._stepped_optimizer
        return None if optimizer is None else optimizer._global_grad_norm

    def get_lr(self) -> list[float]:
        """Learning rate of each parameter group."""
        return self._loop.get_lr()

    def get_mom(self) -> list[Any]:
        """Momentum (``betas`` or ``momentum``) of each parameter group."""
        optimizer = self._stepped_optimizer
        if optimizer is None:
            return []
        return [g.get("betas", g.get("momentum")) for g in optimizer.param_groups]

    def get_type(self) -> list[str]:
        """Inner optimizer class name per parameter group."""
        if self.basic_optimizer is None:
            return []
        return [type(self.basic_optimizer).__name__ for _ in self.basic_optimizer.param_groups]

    def compile(
        self,
        backend: Any = None,
        compile_kwargs: dict = {},  # noqa: B006 - upstream default; never mutated
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """``torch.compile`` the wrapped module in place (upstream keyword form).

        Under ZeRO-3 the parameter fetch/release hooks run eagerly, as graph breaks ([Note: zero3 under compile]
        in docs/design/zero3.md). ``schedule`` (DeepCompile passes) and ``compiled_autograd_enabled`` are refused.
        """
        from deepspeed.accelerator import get_accelerator

        if schedule is not None or compiled_autograd_enabled:
            raise NotImplementedError(
                "engine.compile(schedule=..., compiled_autograd_enabled=True) is not supported "
                "by deepspeed-lean (DeepCompile schedules and compiled autograd are not "
                "implemented); call engine.compile(backend=..., compile_kwargs=...)"
            )

        backend = backend if backend is not None else get_accelerator().get_compile_backend()
        self.module.compile(backend=backend, **compile_kwargs)
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        """True once :meth:`compile` ran."""
        return bool(self.__dict__.get("_is_compiled", False))

    def set_data_post_process_func(self, post_process_func: Any) -> None:
        """Apply ``post_process_func`` to every batch the engine's data loader yields."""
        if self.training_dataloader is not None:
            self.training_dataloader.post_process_func = post_process_func

    def get_wall_clock_timers(self) -> dict:
        """Milliseconds accumulated so far by each phase timer, by upstream's timer names (empty without
        ``wall_clock_breakdown``)."""
        return {name: timer.elapsed(reset=False) for name, timer in self.timers.get_timers().items()}

    def print_forward_breakdown(self, fwd_time: float = 0.0) -> None:
        """Log the forward time given by the caller (no finer breakdown is collected)."""
        log_dist(f"forward time {fwd_time:.2f} ms", ranks=[0])

    # --- observing (config wall_clock_breakdown, timers, the monitors, flops_profiler) -------------------
    @property
    def timers(self) -> Any:
        """The phase timers (``SynchronizedWallClockTimer``; a ``NoopTimer`` without ``wall_clock_breakdown``)."""
        return self._loop.observer.timers

    @property
    def tput_timer(self) -> Any:
        """The ``ThroughputTimer`` (config ``timers.throughput``)."""
        return self._loop.observer.tput_timer

    @property
    def monitor(self) -> Any:
        """The ``MonitorMaster`` of the config's monitor blocks."""
        return self._loop.observer.monitor

    def offload_states(
        self, include: Any = None, device: Any = "cpu", pin_memory: bool = True, non_blocking: bool = False
    ) -> None:
        """Move optimizer state and fp32 masters (and, under ZeRO-3, the 16-bit parameter shards) to host memory
        until :meth:`reload_states`."""
        optimizer = self._stepped_optimizer
        if optimizer is None or getattr(optimizer, "optimizer", None) is None:
            raise ValueError("offload_states needs an engine with an optimizer")
        target = torch.device(getattr(device, "value", device))
        if target.type != "cpu":
            raise ValueError(f"offload_states device={device!r} is not supported; valid: 'cpu'")
        if "_state_offloader" not in self.__dict__:
            self._state_offloader = StateOffloader()
        before = getattr(optimizer, "before_master_access", None)
        if before is not None:  # values kept elsewhere (ZenFlow's device columns) come home first, and go
            before(True)
        self._state_offloader.offload(
            optimizer.optimizer,
            parse_kinds(include, zero3=self.zero3_manager is not None),
            target,
            torch.float32 if pin_memory else None,
            non_blocking,
            manager=self.zero3_manager,
        )
        self._rebind_master_views(optimizer)

    @staticmethod
    def _rebind_master_views(optimizer: Any) -> None:
        # ZeRO-3 shards that are views of a moved fp32 master follow it ([Note: zero3-master]).
        rebind = getattr(optimizer, "rebind_master_views", None)
        if rebind is not None:
            rebind()

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back everything :meth:`offload_states` moved."""
        offloader = self.__dict__.get("_state_offloader")
        if offloader is not None:
            offloader.reload(non_blocking)
            self._rebind_master_views(self._stepped_optimizer)

    def empty_partition_cache(self) -> None:
        """ZeRO-3: release every gathered, non-persistent parameter now."""
        if self.zero3_manager is not None:
            self.zero3_manager.release_all()

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """Full 16-bit state dict on rank 0 (``None`` elsewhere), gathered one module at a time.

        Every rank must call it. Only one module's parameters are gathered at any moment, so saving never
        needs the whole model on one device.
        """
        if self.zero3_manager is None:
            raise ValueError("_zero3_consolidated_16bit_state_dict is only available under ZeRO stage 3")
        rank0 = dist.get_rank() == 0
        out: dict[str, torch.Tensor] = {}
        for prefix, module in self.module.named_modules():
            own = [(n, p) for n, p in module.named_parameters(recurse=False)]
            with GatheredParameters([p for _, p in own], modifier_rank=None):
                for name, p in own:
                    if rank0 and (p.requires_grad or not exclude_frozen_parameters):
                        out.setdefault(f"{prefix}.{name}" if prefix else name, p.detach().cpu().clone())
            for name, buf in module.named_buffers(recurse=False):
                if rank0 and buf is not None and name not in module._non_persistent_buffers_set:
                    out[f"{prefix}.{name}" if prefix else name] = buf.detach().cpu().clone()
        return out if rank0 else None

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict | None:
        """ZeRO-3: the consolidated state dict; otherwise a ValueError (upstream contract)."""
        if self.zero3_manager is not None:
            return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        raise ValueError("consolidated 16-bit state dicts need ZeRO stage 3 (or AutoTP, which is not supported)")

    def destroy(self) -> None:
        """Remove every hook and drop optimizer state so the memory can be reclaimed; write every monitor scalar
        and timer line still queued and close the monitors' files."""
        if self.optimizer is not None:
            self.optimizer.destroy()
            inner = getattr(self.optimizer, "optimizer", None)
            if inner is not None:
                inner.state.clear()
        self.optimizer = None
        self.basic_optimizer = None
        self.lr_scheduler = None
        self._loop.optimizer = None
        self._loop.lr_scheduler = None
        self._loop.observer.close()  # last, so a monitor's write error is raised after the memory is released

    # --- counters (checkpoint loading writes them) -------------------------------------------------
    global_steps = property(
        lambda self: self._loop.global_steps, lambda self, v: setattr(self._loop, "global_steps", v)
    )
    global_samples = property(
        lambda self: self._loop.global_samples, lambda self, v: setattr(self._loop, "global_samples", v)
    )
    skipped_steps = property(
        lambda self: self._loop.skipped_steps, lambda self, v: setattr(self._loop, "skipped_steps", v)
    )
    micro_steps = property(
        lambda self: self._loop.accumulation.micro_steps,
        lambda self, v: setattr(self._loop.accumulation, "micro_steps", v),
    )

    # --- config getters (upstream exposes these as methods) ----------------------------------------
    def zero_optimization_stage(self) -> int:
        """The configured ZeRO stage (0-3)."""
        return self.plan.zero.stage

    def zero_optimization(self) -> bool:
        """True when ZeRO (stage ≥ 1) is on."""
        return self.plan.zero.stage > 0

    def fp16_enabled(self) -> bool:
        """True in fp16 mode."""
        return self.plan.precision.fp16

    def bfloat16_enabled(self) -> bool:
        """True in bf16 mode."""
        return self.plan.precision.bf16

    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step."""
        return self.plan.batch.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        """Global samples per optimizer step."""
        return self.plan.batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        """Samples per micro-step per rank."""
        return self.plan.batch.micro_batch_per_gpu

    def gradient_clipping(self) -> float:
        """Global-norm clip value (0 = off)."""
        return self.plan.grads.clip_norm

    def steps_per_print(self) -> float | None:
        """Progress-report period in optimizer steps."""
        return self.plan.steps_per_print

    def get_batch_info(self) -> tuple[int, int, int]:
        """``(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)``."""
        b = self.plan.batch
        return b.train_batch_size, b.micro_batch_per_gpu, b.gradient_accumulation_steps

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """ZeRO-3: gather full 16-bit weights when saving the model."""
        return self.plan.zero.stage3.gather_16bit_weights_on_model_save

    def dynamic_loss_scale(self) -> bool:
        """True when fp16 uses a dynamic loss scale."""
        ls = self.plan.precision.loss_scale
        return ls is not None and ls.dynamic

    def loss_scale(self) -> float:
        """The static loss scale (0 when dynamic), as upstream reports it."""
        ls = self.plan.precision.loss_scale
        return 0.0 if ls is None or ls.dynamic else ls.static_scale

    @property
    def communication_data_type(self) -> torch.dtype:
        """dtype gradients are reduced in (upstream: a property; under SP, ``seq_parallel_communication_data_type``)."""
        return self.plan.precision.comm_dtype

    @communication_data_type.setter
    def communication_data_type(self, value: torch.dtype) -> None:
        # Read by what is built afterwards (the optimizers copy it when they are created).
        self.plan = dataclasses.replace(self.plan, precision=dataclasses.replace(self.plan.precision, comm_dtype=value))
        if hasattr(self, "_loop"):
            self._loop.plan = self.plan

    def wall_clock_breakdown(self) -> bool:
        """Whether per-phase timers were requested."""
        return self.plan.wall_clock_breakdown

    def memory_breakdown(self) -> bool:
        """Whether per-phase memory reports were requested."""
        return self.plan.memory_breakdown

    def zero_allow_untested_optimizer(self) -> bool:
        """Whether client optimizers outside the tested list are allowed with ZeRO."""
        return self.plan.zero_allow_untested_optimizer

    def module_state_dict(
        self,
        destination: Any = None,
        prefix: str = "",
        keep_vars: bool = False,
        exclude_frozen_parameters: bool = False,
    ) -> dict:
        """State dict of the wrapped module (frozen parameters optionally left out)."""
        sd = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    sd.pop(prefix + name, None)
        return sd

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """Change the global batch size by changing the accumulation steps (micro batch fixed)."""
        b = self.plan.batch
        per_step = b.micro_batch_per_gpu * b.dp_world_size
        if train_batch_size % per_step:
            raise ValueError(
                f"train_batch_size {train_batch_size} is not divisible by micro batch × data-parallel size ({per_step})"
            )
        self._replace_batch(train_batch_size // per_step, b.micro_batch_per_gpu)

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """Change the micro batch (accumulation steps fixed)."""
        self._replace_batch(self.plan.batch.gradient_accumulation_steps, micro_batch_size)

    def _replace_batch(self, gas: int, micro: int) -> None:
        batch = dataclasses.replace(
            self.plan.batch,
            gradient_accumulation_steps=gas,
            micro_batch_per_gpu=micro,
            train_batch_size=gas * micro * self.plan.batch.dp_world_size,
        )
        self.plan = dataclasses.replace(self.plan, batch=batch)
        self._loop.plan = self.plan
        self._loop.accumulation.gas = gas
        self._loop.progress.train_batch_size = batch.train_batch_size


# Upstream's default bucket for reducing gradients in one piece-wise all-reduce (pipeline engines and integrations
# read it); the engine here reduces through its own buckets (``zero_optimization.reduce_bucket_size``).
MEMORY_OPT_ALLREDUCE_SIZE = 500000000


def autocast_if_enabled(engine: DeepSpeedEngine) -> Any:
    """The ``torch.autocast`` context the engine's forward runs under: none here, because the ``torch_autocast``
    block is refused (fp16/bf16 run the model in the working dtype), so the context does nothing."""
    import contextlib

    return contextlib.nullcontext(engine)
