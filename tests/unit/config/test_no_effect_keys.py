"""Keys accepted for upstream configs that change nothing here: a non-default value warns naming the key.

These keys have no field in the run plan (``tests/unit/config/test_plan.py`` checks that); the config surface
(``deepspeed/_core/config/surface.py``) is what tells the user, once per key per process.
"""

from __future__ import annotations

import logging

import pytest

from deepspeed._core.config.surface import SURFACE, Status
from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError

_Z = "zero_optimization."
# key -> (non-default value, other keys the value needs to be valid).
NO_EFFECT = {
    _Z + "contiguous_gradients": (False, {}),
    _Z + "use_multi_rank_bucket_allreduce": (False, {}),
    _Z + "round_robin_gradients": (True, {}),
    _Z + "ignore_unused_parameters": (False, {}),
    _Z + "elastic_checkpoint": (True, {}),
    _Z + "offload_optimizer.fast_init": (True, {_Z + "offload_optimizer.device": "cpu"}),
    _Z + "offload_optimizer.ratio": (0.5, {_Z + "stage": 3, _Z + "offload_optimizer.device": "cpu"}),
}


def _nested(flat: dict) -> dict:
    out: dict = {"train_batch_size": 2}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _warnings(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.levelno == logging.WARNING and "has no effect" in r.getMessage()]


@pytest.mark.parametrize("key", sorted(NO_EFFECT))
def test_non_default_value_warns_naming_the_key(key: str, ds_logs: list[logging.LogRecord]) -> None:
    value, context = NO_EFFECT[key]
    assert SURFACE[key].status is Status.NO_EFFECT
    DeepSpeedConfig(_nested(context))
    assert not _warnings(ds_logs), "the context alone must not warn"
    DeepSpeedConfig(_nested({**context, key: value}))
    assert [w for w in _warnings(ds_logs) if w.startswith(f"{key} is accepted but has no effect")], _warnings(ds_logs)


def test_default_value_does_not_warn(ds_logs: list[logging.LogRecord]) -> None:
    DeepSpeedConfig(_nested({_Z + "contiguous_gradients": True, _Z + "round_robin_gradients": False}))
    assert not _warnings(ds_logs)


def test_managed_gradient_accumulation_false_is_refused() -> None:
    DeepSpeedConfig(_nested({"managed_gradient_accumulation": True}))
    with pytest.raises(DeepSpeedConfigError, match="managed_gradient_accumulation=False"):
        DeepSpeedConfig(_nested({"managed_gradient_accumulation": False}))


@pytest.mark.parametrize("device", ["cpu", "none"])
@pytest.mark.parametrize(
    ("name", "key", "value"),
    [
        ("offload_optimizer", "nvme_path", "/local_nvme"),
        ("offload_param", "nvme_path", "/local_nvme"),
        ("offload_param", "buffer_size", 1000),
    ],
)
def test_nvme_keys_without_nvme_device_warn(
    device: str, name: str, key: str, value: object, ds_logs: list[logging.LogRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVMe-only keys of an offload block do nothing unless its device is ``nvme``: the warning names them."""
    from deepspeed._core.config import offload

    monkeypatch.setattr(offload, "_NVME_KEYS_WARNED", set())  # said once per process: start from none said
    block = f"{_Z}{name}."
    DeepSpeedConfig(_nested({_Z + "stage": 3, block + "device": device}))
    assert not [r for r in ds_logs if "only apply with" in r.getMessage()]
    DeepSpeedConfig(_nested({_Z + "stage": 3, block + "device": device, block + key: value}))
    said = [r.getMessage() for r in ds_logs if "only apply with" in r.getMessage()]
    assert said and f"{block}{key}" in said[-1] and "no effect" in said[-1], said
