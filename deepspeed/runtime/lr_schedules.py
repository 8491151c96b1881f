"""Learning-rate schedules selected by the config's ``scheduler`` block (upstream names and behaviour).

Every schedule counts *batches*, not epochs: ``step()`` is called after each optimizer step and
``last_batch_iteration`` is the index of the batch just trained (``-1`` before training starts). A
schedule built with ``last_batch_iteration=-1`` writes its starting learning rate into the optimizer at
once; one built to resume (``last_batch_iteration >= 0``) leaves the optimizer alone until its first
``step()``. ``state_dict()`` is ``{"last_batch_iteration": n}`` and is all a schedule needs to resume.

Warmup shapes shared by :class:`WarmupLR`, :class:`WarmupDecayLR` and :class:`WarmupCosineLR`, as the
fraction ``g`` of the way from the start value to the peak at batch ``t`` of ``W`` warmup steps:
``"log"``: ``g = log(t + 1) / log(W)``; ``"linear"``: ``g = t / W``; ``g = 1`` from ``t = W`` on.
``W`` is clamped to at least 2 so the log shape is defined.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from deepspeed.utils.logging import logger

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

LR_RANGE_TEST_MIN_LR = "lr_range_test_min_lr"
LR_RANGE_TEST_STEP_RATE = "lr_range_test_step_rate"
LR_RANGE_TEST_STEP_SIZE = "lr_range_test_step_size"
LR_RANGE_TEST_STAIRCASE = "lr_range_test_staircase"

EDGE_VALUE = "edge_value"
MID_VALUE = "mid_value"

CYCLE_FIRST_STEP_SIZE = "cycle_first_step_size"
CYCLE_FIRST_STAIR_COUNT = "cycle_first_stair_count"
CYCLE_SECOND_STEP_SIZE = "cycle_second_step_size"
CYCLE_SECOND_STAIR_COUNT = "cycle_second_stair_count"
DECAY_STEP_SIZE = "decay_step_size"

CYCLE_MIN_LR = "cycle_min_lr"
CYCLE_MAX_LR = "cycle_max_lr"
DECAY_LR_RATE = "decay_lr_rate"

CYCLE_MIN_MOM = "cycle_min_mom"
CYCLE_MAX_MOM = "cycle_max_mom"
DECAY_MOM_RATE = "decay_mom_rate"

WARMUP_MIN_LR = "warmup_min_lr"
WARMUP_MAX_LR = "warmup_max_lr"
WARMUP_NUM_STEPS = "warmup_num_steps"
WARMUP_TYPE = "warmup_type"
WARMUP_LOG_RATE = "log"
WARMUP_LINEAR_RATE = "linear"

WARMUP_MIN_RATIO = "warmup_min_ratio"
COS_MIN_RATIO = "cos_min_ratio"

TOTAL_NUM_STEPS = "total_num_steps"

# Command-line flags of add_tuning_arguments: (flag, argparse keyword arguments). Names, types and
# defaults are upstream's, since scripts parse them and feed get_config_from_args.
_TUNING_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--lr_schedule", dict(type=str, default=None, help="LR schedule name.")),
    ("--lr_range_test_min_lr", dict(type=float, default=0.001, help="LR range test: first learning rate.")),
    ("--lr_range_test_step_rate", dict(type=float, default=1.0, help="LR range test: growth per interval.")),
    ("--lr_range_test_step_size", dict(type=int, default=1000, help="LR range test: batches per interval.")),
    ("--lr_range_test_staircase", dict(type=bool, default=False, help="LR range test: grow in steps.")),
    ("--cycle_first_step_size", dict(type=int, default=1000, help="1Cycle: batches in the rising half.")),
    ("--cycle_first_stair_count", dict(type=int, default=-1, help="1Cycle: stairs in the rising half.")),
    ("--cycle_second_step_size", dict(type=int, default=-1, help="1Cycle: batches in the falling half.")),
    ("--cycle_second_stair_count", dict(type=int, default=-1, help="1Cycle: stairs in the falling half.")),
    ("--decay_step_size", dict(type=int, default=1000, help="1Cycle: batches per decay interval.")),
    ("--cycle_min_lr", dict(type=float, default=0.01, help="1Cycle: lowest learning rate.")),
    ("--cycle_max_lr", dict(type=float, default=0.1, help="1Cycle: highest learning rate.")),
    ("--decay_lr_rate", dict(type=float, default=0.0, help="1Cycle: learning-rate decay after the cycle.")),
    ("--cycle_momentum", dict(default=False, action="store_true", help="1Cycle: cycle momentum too.")),
    ("--cycle_min_mom", dict(type=float, default=0.8, help="1Cycle: lowest momentum.")),
    ("--cycle_max_mom", dict(type=float, default=0.9, help="1Cycle: highest momentum.")),
    ("--decay_mom_rate", dict(type=float, default=0.0, help="1Cycle: momentum decay after the cycle.")),
    ("--warmup_min_lr", dict(type=float, default=0, help="Warmup: starting learning rate.")),
    ("--warmup_max_lr", dict(type=float, default=0.001, help="Warmup: peak learning rate.")),
    ("--warmup_num_steps", dict(type=int, default=1000, help="Warmup: batches to reach the peak.")),
    ("--warmup_type", dict(type=str, default=WARMUP_LOG_RATE, help="Warmup shape: 'log' or 'linear'.")),
    ("--warmup_min_ratio", dict(type=float, default=0.01, help="Cosine: starting fraction of the lr.")),
    ("--cos_min_ratio", dict(type=float, default=0.01, help="Cosine: final fraction of the lr.")),
)

_LR_RANGE_TEST_KEYS = (LR_RANGE_TEST_MIN_LR, LR_RANGE_TEST_STEP_RATE, LR_RANGE_TEST_STEP_SIZE, LR_RANGE_TEST_STAIRCASE)
_ONE_CYCLE_KEYS = (
    CYCLE_FIRST_STEP_SIZE, CYCLE_FIRST_STAIR_COUNT, CYCLE_SECOND_STEP_SIZE, CYCLE_SECOND_STAIR_COUNT,
    DECAY_STEP_SIZE, CYCLE_MIN_LR, CYCLE_MAX_LR, DECAY_LR_RATE, CYCLE_MIN_MOM, CYCLE_MAX_MOM, DECAY_MOM_RATE,
)  # fmt: skip
_WARMUP_KEYS = (WARMUP_MIN_LR, WARMUP_MAX_LR, WARMUP_NUM_STEPS, WARMUP_TYPE)


# ----------------------------------------------------------------------------------------------------
# Command line and config helpers
# ----------------------------------------------------------------------------------------------------


def add_tuning_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the schedule flags (``--lr_schedule``, ``--warmup_num_steps``, ...) to ``parser``; returns it."""
    group = parser.add_argument_group("Convergence Tuning", "Convergence tuning configurations")
    for flag, kwargs in _TUNING_FLAGS:
        group.add_argument(flag, **kwargs)
    return parser


def parse_arguments() -> tuple[argparse.Namespace, list[str]]:
    """Parse the schedule flags from ``sys.argv``; returns ``(known_args, unknown_args)``."""
    parser = add_tuning_arguments(argparse.ArgumentParser())
    return parser.parse_known_args()


def _copy_set_args(args: argparse.Namespace, params: dict, keys: Iterable[str]) -> None:
    """Copy each of ``keys`` that ``args`` has with a non-None value into ``params``."""
    for key in keys:
        value = getattr(args, key, None)
        if value is not None:
            params[key] = value


def override_lr_range_test_params(args: argparse.Namespace, params: dict) -> None:
    """Overwrite LR range test entries of ``params`` with the ones given on the command line."""
    _copy_set_args(args, params, _LR_RANGE_TEST_KEYS)


def override_1cycle_params(args: argparse.Namespace, params: dict) -> None:
    """Overwrite OneCycle entries of ``params`` with the ones given on the command line."""
    _copy_set_args(args, params, _ONE_CYCLE_KEYS)


def override_warmupLR_params(args: argparse.Namespace, params: dict) -> None:
    """Overwrite warmup entries of ``params`` with the ones given on the command line."""
    _copy_set_args(args, params, _WARMUP_KEYS)


def override_params(args: argparse.Namespace, params: dict) -> None:
    """Overwrite every schedule entry of ``params`` that was given on the command line."""
    override_lr_range_test_params(args, params)
    override_1cycle_params(args, params)
    override_warmupLR_params(args, params)


def get_config_from_args(args: argparse.Namespace) -> tuple[dict | None, str | None]:
    """Build a ``scheduler`` config block from parsed flags.

    Returns ``(config, None)``, or ``(None, reason)`` when no valid ``--lr_schedule`` was given.
    """
    schedule = getattr(args, LR_SCHEDULE, None)
    if schedule is None:
        return None, f"--{LR_SCHEDULE} not specified on command line"
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not supported LR schedule"
    params: dict = {}
    if schedule == LR_RANGE_TEST:
        override_lr_range_test_params(args, params)
    elif schedule == ONE_CYCLE:
        override_1cycle_params(args, params)
    else:
        override_warmupLR_params(args, params)
    return {"type": schedule, "params": params}, None


def get_lr_from_config(config: dict) -> tuple[Any, str]:
    """The headline learning rate of a ``scheduler`` config block.

    Returns ``(lr, "")``: the range test's starting lr, OneCycle's maximum, or the warmup peak; or
    ``(None, reason)`` when the block is malformed.
    """
    if "type" not in config:
        return None, "LR schedule type not defined in config"
    if "params" not in config:
        return None, "LR schedule params not defined in config"
    schedule, params = config["type"], config["params"]
    if schedule not in VALID_LR_SCHEDULES:
        return None, f"{schedule} is not a valid LR schedule"
    if schedule == LR_RANGE_TEST:
        return params[LR_RANGE_TEST_MIN_LR], ""
    if schedule == ONE_CYCLE:
        return params[CYCLE_MAX_LR], ""
    return params[WARMUP_MAX_LR], ""


# ----------------------------------------------------------------------------------------------------
# Optimizer plumbing
# ----------------------------------------------------------------------------------------------------


def get_torch_optimizer(optimizer: Any) -> Any:
    """Return the object whose ``param_groups`` a schedule should drive.

    A torch optimizer is used as is; a wrapper (ZeRO/fp16 optimizer) is unwrapped through its
    ``optimizer`` attribute. Any other object with ``param_groups`` is accepted too, so schedules work
    with optimizer-like wrappers that are not ``torch.optim.Optimizer`` subclasses.
    """
    if isinstance(optimizer, Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, Optimizer):
        return inner
    if hasattr(optimizer, "param_groups"):
        return optimizer
    raise TypeError(f"{type(optimizer).__name__} is not a subclass of torch.optim.Optimizer")


def update_lr(param_groups: list[dict], lrs: Sequence[Any]) -> list[Any]:
    """Write ``lrs`` into ``param_groups`` (one per group) and return the values now in the groups.

    A group whose lr is a tensor (capturable/compiled optimizers) is updated in place, keeping its
    dtype, device and shape; the returned list holds a copy so it does not change on later steps.
    """
    # A group added to the optimizer after the scheduler was built keeps its own lr, as upstream's does.
    for group, lr in zip(param_groups, lrs, strict=False):
        if torch.is_tensor(group["lr"]):
            group["lr"].fill_(float(lr))
        else:
            group["lr"] = lr
    return [g["lr"].detach().clone() if torch.is_tensor(g["lr"]) else g["lr"] for g in param_groups]


def _per_group(optimizer: Any, value: Any, name: str) -> list:
    """Broadcast a scalar to every param group, or check a list/tuple has one entry per group."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"expected {n} value for {name}, got {len(value)}: {list(value)}")
        return list(value)
    return [value] * n


def _snapshot(lr: Any) -> Any:
    """A plain number for a tensor lr, so a stored base value does not follow later in-place updates."""
    return float(lr) if torch.is_tensor(lr) else lr


def _check_positive_int(value: Any, name: str) -> int:
    # bool is an int subclass; True as a step count is a config mistake, not 1.
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _check_warmup_type(warmup_type: str) -> str:
    """Return ``warmup_type``, or "log" (with a warning) for an unknown shape, as upstream does."""
    if warmup_type in (WARMUP_LOG_RATE, WARMUP_LINEAR_RATE):
        return warmup_type
    logger.warning(f"Using unknown warmup_type: {warmup_type}. The increasing function is set to default (log)")
    return WARMUP_LOG_RATE


def _warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the warmup done at batch ``iteration`` (see the module docstring); 1.0 once done."""
    if iteration >= warmup_num_steps:
        return 1.0
    if warmup_type == WARMUP_LOG_RATE:
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


# ----------------------------------------------------------------------------------------------------
# Schedules
# ----------------------------------------------------------------------------------------------------


class _BatchSchedule:
    """Shared bookkeeping: the batch counter, writing lrs to the optimizer, state dict."""

    optimizer: Any
    last_batch_iteration: int

    def _start(self, last_batch_iteration: int) -> None:
        """Set the counter; a fresh schedule (``-1``) writes its starting lr into the optimizer now."""
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = update_lr(self.optimizer.param_groups, self._compute_lr())

    def _compute_lr(self) -> list[Any]:
        raise NotImplementedError

    def _advance(self, iteration: int | None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if iteration is None else iteration
        self._last_lr = update_lr(self.optimizer.param_groups, self._compute_lr())

    def _format_param(self, optimizer: Any, param_value: Any, param_name: str) -> list:
        """One value per param group (kept under upstream's name for subclasses that call it)."""
        return _per_group(optimizer, param_value, param_name)

    def get_lr(self) -> list[Any]:
        """Learning rate of each param group at ``last_batch_iteration`` (computed, not applied)."""
        if self.last_batch_iteration < 0:
            logger.warning("Attempting to get learning rate from scheduler before it has started")
        return self._compute_lr()

    def get_last_lr(self) -> list[Any]:
        """Learning rates the schedule last wrote into the optimizer.

        Raises AssertionError ("need to call step() first") when nothing has been written yet, i.e. a
        resumed schedule before its first ``step()``; HF Trainer recognises that message.
        """
        assert getattr(self, "_last_lr", None) is not None, "need to call step() first"
        return self._last_lr

    def state_dict(self) -> dict[str, int]:
        """``{"last_batch_iteration": n}``: everything needed to resume the schedule."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        """Resume from :meth:`state_dict` output; the next ``step()`` applies the resumed lr."""
        self.last_batch_iteration = sd["last_batch_iteration"]


class LRRangeTest(_BatchSchedule):
    """Learning-rate range test: grow the lr from a base value to find where training diverges.

    ``lr = lr_range_test_min_lr * (1 + lr_range_test_step_rate * k)`` with
    ``k = (last_batch_iteration + 1) / lr_range_test_step_size``, floored when
    ``lr_range_test_staircase`` (so the lr changes only every ``lr_range_test_step_size`` batches).

    Args:
        optimizer: torch optimizer (or a wrapper exposing one as ``.optimizer``).
        lr_range_test_min_lr: starting lr; a list gives one per param group.
        lr_range_test_step_size: batches per growth interval.
        lr_range_test_step_rate: growth per interval, relative to the starting lr.
        lr_range_test_staircase: grow in discrete steps instead of continuously.
        last_batch_iteration: index of the last trained batch, ``-1`` to start fresh.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        lr_range_test_min_lr: float = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ) -> None:
        self.optimizer = get_torch_optimizer(optimizer)
        self.min_lr = _per_group(self.optimizer, lr_range_test_min_lr, LR_RANGE_TEST_MIN_LR)
        if not lr_range_test_step_size > 0:
            raise ValueError(f"{LR_RANGE_TEST_STEP_SIZE} must be > 0, got {lr_range_test_step_size!r}")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        self._start(last_batch_iteration)

    def _interval(self) -> float:
        intervals = (self.last_batch_iteration + 1) / self.step_size
        return math.floor(intervals) if self.staircase else intervals

    def _compute_lr(self) -> list[float]:
        growth = 1 + self.step_rate * self._interval()
        return [lr * growth for lr in self.min_lr]

    def step(self, batch_iteration: int | None = None) -> None:
        """Move to batch ``batch_iteration`` (default: the next one) and apply its lr."""
        self._advance(batch_iteration)


class OneCycle(_BatchSchedule):
    """1Cycle policy: one triangular lr cycle (momentum moving the opposite way), then decay.

    Phases, with ``b = last_batch_iteration + 1`` and a cycle of ``first + second`` batches:

    * rising half (``b <= first``): lr goes from ``cycle_min_lr`` to ``cycle_max_lr`` linearly, and
      momentum from ``cycle_max_mom`` down to ``cycle_min_mom``;
    * falling half: the mirror image, back to ``cycle_min_lr`` / ``cycle_max_mom`` at ``b = first + second``;
    * decay (``last_batch_iteration >= first + second``), with ``d = last_batch_iteration - cycle + 1``:
      ``lr = cycle_min_lr / (1 + decay_lr_rate * d / decay_step_size)`` and
      ``mom = cycle_max_mom * (1 + decay_mom_rate * d / decay_step_size)``; a zero rate or a zero
      ``decay_step_size`` holds the end-of-cycle values instead.

    A stair count ``n > 0`` for a half holds the values flat over ``n`` equal stairs of that half.
    Momentum is written to each group's ``betas[0]`` (with ``betas[1]`` set to 0.99, as upstream does,
    so runs match it step for step); optimizers without ``betas`` in their defaults, such as SGD, keep
    their momentum and a warning says so.

    Args:
        optimizer: torch optimizer (or a wrapper exposing one as ``.optimizer``).
        cycle_min_lr: lr at the start and end of the cycle.
        cycle_max_lr: lr at the peak of the cycle.
        decay_lr_rate: lr decay rate after the cycle.
        cycle_first_step_size: batches in the rising half.
        cycle_second_step_size: batches in the falling half (default: same as the rising half).
        cycle_first_stair_count: stairs in the rising half (0: continuous).
        cycle_second_stair_count: stairs in the falling half (default: same as the rising half).
        decay_step_size: batches per decay interval (0: no decay).
        cycle_momentum: cycle momentum inversely to the lr.
        cycle_min_mom: momentum at the peak of the lr cycle.
        cycle_max_mom: momentum at the start and end of the cycle.
        decay_mom_rate: momentum decay rate after the cycle.
        last_batch_iteration: index of the last trained batch, ``-1`` to start fresh.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        cycle_min_lr: float,
        cycle_max_lr: float,
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float = 0.8,
        cycle_max_mom: float = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ) -> None:
        self.optimizer = get_torch_optimizer(optimizer)
        self._init_cycle(cycle_first_step_size, cycle_second_step_size, cycle_first_stair_count,
                         cycle_second_stair_count, decay_step_size)  # fmt: skip
        self.min_lrs = _per_group(self.optimizer, cycle_min_lr, CYCLE_MIN_LR)
        self.max_lrs = _per_group(self.optimizer, cycle_max_lr, CYCLE_MAX_LR)
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0)
        self.decay_mom_rate = decay_mom_rate
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_mom_rate, 0)
        self.cycle_momentum = cycle_momentum and self._supports_betas()
        self.min_moms = [(m, 0.99) for m in _per_group(self.optimizer, cycle_min_mom, CYCLE_MIN_MOM)]
        self.max_moms = [(m, 0.99) for m in _per_group(self.optimizer, cycle_max_mom, CYCLE_MAX_MOM)]
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            # Starting values go in directly: upstream leaves get_last_lr() unset until the first step,
            # and starts momentum at cycle_min_mom (not at the cycle formula's value); both kept.
            for group, lr in zip(self.optimizer.param_groups, self.min_lrs, strict=True):
                group["lr"] = lr
            if self.cycle_momentum:
                self._apply_momentum(self.min_moms)

    def _init_cycle(
        self,
        first_step_size: int,
        second_step_size: int | None,
        first_stair_count: int,
        second_stair_count: int | None,
        decay_step_size: int,
    ) -> None:
        if not first_step_size > 0:
            raise ValueError(f"{CYCLE_FIRST_STEP_SIZE} must be > 0, got {first_step_size!r}")
        if second_step_size is not None and not second_step_size > 0:
            raise ValueError(f"{CYCLE_SECOND_STEP_SIZE} must be > 0, got {second_step_size!r}")
        self.first_step_size = float(first_step_size)
        self.second_step_size = self.first_step_size if second_step_size is None else float(second_step_size)
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size
        self.first_stair_count = first_stair_count
        self.second_stair_count = first_stair_count if second_stair_count is None else second_stair_count
        self.decay_step_size = decay_step_size

    def _supports_betas(self) -> bool:
        if "betas" in getattr(self.optimizer, "defaults", {}):
            return True
        logger.warning(
            f"cycle_momentum is disabled because optimizer {type(self.optimizer).__name__} does not support "
            "momentum, no betas attribute in defaults"
        )
        return False

    def _cycle_position(self) -> float:
        """Height within the cycle at the current batch: 0 at the ends, 1 at the peak."""
        b = self.last_batch_iteration + 1
        in_cycle = b % self.total_size
        rising = in_cycle <= self.first_step_size
        stairs = self.first_stair_count if rising else self.second_stair_count
        if rising:
            # Written with the integer batch offset rather than a float ratio, so an exact stair or
            # the peak is never lost to rounding (e.g. 0.9999999 floored to the stair below).
            steps_done, half = in_cycle, self.first_step_size
        else:
            steps_done, half = self.total_size - in_cycle, self.second_step_size
        if stairs > 0:
            return math.floor(steps_done * stairs / half) / stairs
        return steps_done / half

    def _decay_intervals(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def _in_cycle(self) -> bool:
        return self.last_batch_iteration < self.total_size

    def _compute_lr(self) -> list[float]:
        if self._in_cycle():
            height = self._cycle_position()
            return [lo + (hi - lo) * height for lo, hi in zip(self.min_lrs, self.max_lrs, strict=True)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * self._decay_intervals()
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """``betas`` each param group gets at ``last_batch_iteration``; None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        if self._in_cycle():
            height = self._cycle_position()
            return [
                (hi[0] - (hi[0] - lo[0]) * height, lo[1]) for lo, hi in zip(self.min_moms, self.max_moms, strict=True)
            ]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * self._decay_intervals()
        return [(hi[0] * factor, hi[1]) for hi in self.max_moms]

    def _apply_momentum(self, betas: list[tuple[float, float]]) -> None:
        # As update_lr: a group added after construction keeps its own betas.
        for group, value in zip(self.optimizer.param_groups, betas, strict=False):
            group["betas"] = value

    def step(self, batch_iteration: int | None = None) -> None:
        """Move to batch ``batch_iteration`` (default: the next one); apply its lr and momentum."""
        self._advance(batch_iteration)
        betas = self.get_mom()  # None when momentum is not cycled
        if betas is not None:
            self._apply_momentum(betas)


class WarmupLR(_BatchSchedule):
    """Warm the lr up from ``warmup_min_lr`` to ``warmup_max_lr`` over ``warmup_num_steps``, then hold it.

    Args:
        optimizer: torch optimizer (or a wrapper exposing one as ``.optimizer``).
        warmup_min_lr: starting lr; a list gives one per param group.
        warmup_max_lr: peak lr; None takes the first param group's current lr.
        warmup_num_steps: batches to reach the peak; must be a positive int (clamped to at least 2).
        warmup_type: ``"log"`` or ``"linear"`` (see the module docstring).
        last_batch_iteration: index of the last trained batch, ``-1`` to start fresh.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        _check_positive_int(warmup_num_steps, WARMUP_NUM_STEPS)
        self.optimizer = get_torch_optimizer(optimizer)
        if warmup_max_lr is None:
            # Upstream takes the first group's lr for every group; kept so runs match it.
            warmup_max_lr = _snapshot(self.optimizer.param_groups[0]["lr"])
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, WARMUP_MIN_LR)
        self.max_lrs = _per_group(self.optimizer, warmup_max_lr, WARMUP_MAX_LR)
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs, strict=True)]
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = _check_warmup_type(warmup_type)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        self._start(last_batch_iteration)

    def _gamma(self) -> float:
        """Fraction of the way from ``warmup_min_lr`` to ``warmup_max_lr``."""
        return _warmup_fraction(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)

    def _compute_lr(self) -> list[Any]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs, strict=True)]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Move to batch ``last_batch_iteration`` (default: the next one) and apply its lr."""
        self._advance(last_batch_iteration)


class WarmupDecayLR(WarmupLR):
    """:class:`WarmupLR`, then a linear decay from ``warmup_max_lr`` at ``warmup_num_steps`` back to
    ``warmup_min_lr`` (0 by default) at ``total_num_steps``.

    After warmup, ``lr = min + (max - min) * (total_num_steps - t) / (total_num_steps - W)``, never below
    ``warmup_min_lr``; the denominator is at least 1.

    Args:
        optimizer: torch optimizer (or a wrapper exposing one as ``.optimizer``).
        total_num_steps: batch at which the decay reaches the end.
        warmup_min_lr: starting lr; a list gives one per param group.
        warmup_max_lr: peak lr.
        warmup_num_steps: batches to reach the peak; must be a positive int (clamped to at least 2).
        warmup_type: ``"log"`` or ``"linear"``.
        last_batch_iteration: index of the last trained batch, ``-1`` to start fresh.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_lr: float = 0.0,
        warmup_max_lr: float = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}")

    def _gamma(self) -> float:
        t = self.last_batch_iteration
        if t < self.warmup_num_steps:
            return super()._gamma()
        decay_span = max(1.0, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - t) / decay_span)


class WarmupCosineLR(_BatchSchedule):
    """Warmup then cosine decay, as ratios of each param group's lr when the schedule is built.

    Warmup takes the ratio from ``warmup_min_ratio`` to 1 (log or linear shape); afterwards, with
    ``p = min(1, (t - W + 1) / max(1, total_num_steps - W))``,
    ``ratio = cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2``, which stays at
    ``cos_min_ratio`` from ``total_num_steps`` on. Before training starts the ratio is 0.

    Args:
        optimizer: torch optimizer (or a wrapper exposing one as ``.optimizer``).
        total_num_steps: batch at which the cosine reaches ``cos_min_ratio``.
        warmup_min_ratio: ratio at the first batch.
        warmup_num_steps: batches to reach ratio 1; must be a positive int (clamped to at least 2).
        cos_min_ratio: final ratio.
        warmup_type: ``"log"`` or ``"linear"``.
        last_batch_iteration: index of the last trained batch, ``-1`` to start fresh.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = WARMUP_LOG_RATE,
        last_batch_iteration: int = -1,
    ) -> None:
        _check_positive_int(warmup_num_steps, WARMUP_NUM_STEPS)
        self.optimizer = get_torch_optimizer(optimizer)
        self.total_num_steps = total_num_steps
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _check_warmup_type(warmup_type)
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.inverse_log_warm_up = 1.0 / math.log(self.warmup_num_steps)
        if self.total_num_steps < self.warmup_num_steps:
            logger.warning(f"total_num_steps {total_num_steps} is less than warmup_num_steps {warmup_num_steps}")
        self.org_lrs = [_snapshot(group["lr"]) for group in self.optimizer.param_groups]
        self._start(last_batch_iteration)

    def get_lr_ratio(self) -> float:
        """Multiplier applied to every group's original lr at ``last_batch_iteration``."""
        t = self.last_batch_iteration
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            gamma = _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + gamma * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (t - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def _compute_lr(self) -> list[Any]:
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Move to batch ``last_batch_iteration`` (default: the next one) and apply its lr."""
        self._advance(last_batch_iteration)
