"""``DeepSpeedEngine``'s checkpoint methods with upstream's signatures.

The methods gather what the engine knows (ranks, stage, precision, counters, config) into the plain
objects of ``deepspeed._core.checkpoint.save_load`` and delegate; the layout, atomic writes and safe
loading live there (see ``docs/checkpoints.md``).

Safe loading: files are read with ``torch.load(weights_only=True)`` and a small allow-list. To read a
trusted legacy checkpoint whose client state holds other objects, set ``DS_CHECKPOINT_TRUSTED=1``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from deepspeed import comm as dist
from deepspeed._core.checkpoint import files as checkpoint_io
from deepspeed._core.checkpoint import save_load as ckpt
from deepspeed._core.checkpoint import universal_load
from deepspeed._core.config.plan import RunPlan
from deepspeed.checkpoint.constants import CHECKPOINT_PARALLEL_DIMS
from deepspeed.git_version_info import version as _DS_VERSION
from deepspeed.moe._setup import moe_checkpoint_layout
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.logging import logger
from deepspeed.utils.tensor_fragment import fragment_address

# ZeRO optimizer shards pickle ``zero_stage`` as this enum (ours and upstream's).
checkpoint_io.register_safe_globals([ZeroStageEnum, fragment_address])

_ZERO_TO_FP32_SOURCE = str(Path(__file__).resolve().parents[1] / "utils" / "zero_to_fp32.py")


class EngineCheckpointMixin:
    """Checkpoint save/load for :class:`~deepspeed.runtime.engine.DeepSpeedEngine`.

    Relies on engine attributes: ``module``, ``optimizer``, ``lr_scheduler``, ``mpu``, ``dp_group``,
    ``dp_world_size``, ``mp_world_size``, ``global_rank``, ``local_rank``, ``config``, ``_config``, the
    counters ``global_steps`` / ``global_samples`` / ``skipped_steps`` and the config getters.
    """

    if TYPE_CHECKING:
        # What DeepSpeedEngine, the one class this is mixed into, provides; declared for the type checker only.
        module: torch.nn.Module
        optimizer: Any
        lr_scheduler: Any
        mpu: Any
        dp_group: Any
        dp_world_size: int
        mp_world_size: int
        local_rank: int
        config: dict
        _config: Any
        plan: RunPlan
        zero_optimization_stage: Callable[[], int]
        bfloat16_enabled: Callable[[], bool]
        train_batch_size: Callable[[], int]
        zero_gather_16bit_weights_on_model_save: Callable[[], bool]
        _zero3_consolidated_16bit_state_dict: Callable[..., dict | None]
        module_state_dict: Callable[..., dict]

    # --- upstream-named helpers ------------------------------------------------------------------
    def load_universal_checkpoint(self) -> bool:
        """``checkpoint.load_universal``: ``load_checkpoint`` reads universal checkpoints."""
        return bool(self.plan.load_universal)

    def _checkpoint_topology(self) -> ckpt.CheckpointTopology:
        # Under sequence parallelism the mpu's model-parallel queries name the SP group; there is no model parallelism.
        sp = getattr(self, "sequence_parallel_size", 1) > 1
        mp_rank = self.mpu.get_model_parallel_rank() if self.mpu is not None and not sp else 0
        return ckpt.CheckpointTopology(
            zero_stage=int(self.zero_optimization_stage()),
            bf16=bool(self.bfloat16_enabled()),
            global_rank=dist.get_rank(),
            local_rank=int(self.local_rank),
            dp_rank=dist.get_rank(group=self.dp_group),
            dp_world_size=int(getattr(self, "seq_dp_world_size", self.dp_world_size)),
            mp_rank=int(mp_rank),
            mp_world_size=int(self.mp_world_size),
            node_local_storage=bool(self._config.use_node_local_storage),
        )

    def _checkpoint_subject(self) -> ckpt.CheckpointSubject:
        return ckpt.CheckpointSubject(
            module=self.module,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            topology=self._checkpoint_topology(),
            ds_config=self.config,
            ds_version=_DS_VERSION,
            dp_group=self.dp_group,
            zero_to_fp32_source=_ZERO_TO_FP32_SOURCE,
            load_from_fp32_weights=bool(self.plan.zero.load_from_fp32_weights),
            moe=moe_checkpoint_layout(self.module) if getattr(self, "has_moe_layers", False) else None,
        )

    def _get_ckpt_name(self, checkpoints_path: str, tag: str, mp_placeholder: str | None = None) -> str:
        """Path of this rank's model-states file (``mp_placeholder`` replaces the ``NN`` of ``mp_rank_NN``)."""
        name = ckpt.model_file_name(self._checkpoint_topology())
        if mp_placeholder is not None:
            name = name.replace(f"mp_rank_{self._checkpoint_topology().mp_rank:02d}", f"mp_rank_{mp_placeholder}")
        return os.path.join(checkpoints_path, str(tag), name)

    def _get_zero_ckpt_name(self, checkpoints_path: str, tag: str) -> str:
        """Path of this rank's ZeRO optimizer-states file."""
        topo = self._checkpoint_topology()
        return os.path.join(checkpoints_path, str(tag), ckpt.optim_file_name(topo, topo.dp_rank))

    # --- save ------------------------------------------------------------------------------------
    def save_checkpoint(
        self,
        save_dir: str,
        tag: Any = None,
        client_state: dict = {},  # noqa: B006 - upstream's signature; never mutated here
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save a training checkpoint under ``<save_dir>/<tag>`` in upstream DeepSpeed's layout.

        Must be called on every rank. ``tag`` defaults to ``global_step<N>``. ``client_state`` entries are
        stored next to the engine's and returned by :meth:`load_checkpoint`. With ``save_latest`` the file
        ``<save_dir>/latest`` is pointed at this tag, after every rank has committed its files.
        ``exclude_frozen_parameters`` leaves parameters with ``requires_grad=False`` out of the module
        state (PEFT adapters). Returns True.

        Raises:
            ValueError: ``save_dir`` is empty.
            KeyError: ``client_state`` uses the reserved key ``checkpoint_parallel_dimensions``.
        """
        if save_dir is None or not os.fspath(save_dir):
            raise ValueError("save_checkpoint: save_dir must be a non-empty path")
        if CHECKPOINT_PARALLEL_DIMS in client_state:
            raise KeyError(f"client_state must not use the reserved key '{CHECKPOINT_PARALLEL_DIMS}'")
        request = ckpt.SaveRequest(
            save_dir=os.fspath(save_dir),
            tag=ckpt.default_tag(self.global_steps) if tag is None else str(tag),
            save_latest=bool(save_latest),
            exclude_frozen_parameters=bool(exclude_frozen_parameters),
            tag_validation=str(self._config.checkpoint_config.tag_validation).upper(),
        )
        counters = {
            "global_steps": self.global_steps,
            "global_samples": self.global_samples,
            "skipped_steps": self.skipped_steps,
        }
        ckpt.save_checkpoint(
            self._checkpoint_subject(),
            request,
            lambda: self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters),
            counters,
            dict(client_state),
        )
        return True

    # --- load ------------------------------------------------------------------------------------
    def load_checkpoint(
        self,
        load_dir: str,
        tag: Any = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict | None]:
        """Load ``<load_dir>/<tag>`` (tag from ``<load_dir>/latest`` when None) into this engine.

        Restores the module (``load_module_strict``, or through ``custom_load_fn(src=..., dst=module)``),
        the optimizer state incl. fp32 masters and loss scaler, the scheduler and the step counters.
        ``load_module_only`` restores the module alone and rebuilds fp32 masters from it.

        With ``checkpoint.load_universal`` the folder is a universal checkpoint (written by
        ``python -m deepspeed.checkpoint.ds_to_universal``; tag from ``latest_universal``), loadable at any
        data-parallel size and ZeRO stage 1-3.

        Returns:
            ``(load_path, client_state)``; ``(None, None)`` when no tag is given and ``latest`` is missing.

        Raises:
            deepspeed._core.checkpoint.files.CheckpointError: a file is missing, corrupt, or refused
                by safe loading; the message names the file and the rank.
        """
        request = ckpt.LoadRequest(
            load_dir=os.fspath(load_dir),
            tag=None if tag is None else str(tag),
            module_strict=bool(load_module_strict),
            optimizer_states=bool(load_optimizer_states),
            lr_scheduler_states=bool(load_lr_scheduler_states),
            module_only=bool(load_module_only),
            custom_load_fn=custom_load_fn,
            trust=checkpoint_io.LoadTrust.from_env(),
        )
        outcome: ckpt.LoadOutcome | None
        if self.load_universal_checkpoint():
            outcome = universal_load.load_universal_checkpoint(self._checkpoint_subject(), request)
        else:
            outcome = ckpt.load_checkpoint(self._checkpoint_subject(), request)
        if outcome is None:
            return None, None
        if not load_module_only:
            self._restore_counters(outcome.state)
        return outcome.path, outcome.client_state

    def _restore_counters(self, state: dict) -> None:
        self.global_steps = int(state.get("global_steps", 0))
        self.global_samples = int(state.get("global_samples", self.global_steps * self.train_batch_size()))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.loaded_checkpoint_mp_world_size = state.get("mp_world_size")
        self.loaded_checkpoint_dp_world_size = state.get("dp_world_size")

    # --- 16-bit export ---------------------------------------------------------------------------
    def save_16bit_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """Save the module's weights in their training dtype to ``<save_dir>/<save_filename>`` (rank 0 writes).

        Under ZeRO-3 every rank must call it, and it needs
        ``zero_optimization.stage3_gather_16bit_weights_on_model_save``; without that flag nothing is
        written and False is returned. Returns True when saved.
        """
        if self.zero_optimization_stage() >= 3:
            if not self.zero_gather_16bit_weights_on_model_save():
                logger.warning(
                    "save_16bit_model did nothing: under ZeRO-3 set "
                    "zero_optimization.stage3_gather_16bit_weights_on_model_save=true, or use save_checkpoint() "
                    "and zero_to_fp32.py"
                )
                return False
            state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        else:
            state = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
        if dist.get_rank() == 0:
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(os.fspath(save_dir), save_filename)
            checkpoint_io.atomic_save(ckpt.compact_tensors(state), path)
        return True

    def save_fp16_model(
        self, save_dir: str, save_filename: str = "pytorch_model.bin", exclude_frozen_parameters: bool = False
    ) -> bool:
        """Deprecated alias of :meth:`save_16bit_model`."""
        return self.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)
