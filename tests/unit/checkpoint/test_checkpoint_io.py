"""Atomic writes and pickle-safe loading of checkpoint files (no process group needed)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from deepspeed._core.checkpoint import files as io
from deepspeed.checkpoint.utils import clone_tensors_for_torch_save
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

MARKER_ENV = "DS_TEST_PWNED_MARKER"


class Exploit:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


class LegacyBlob:
    """A harmless but non-allow-listed class, as old client states hold (e.g. argparse.Namespace)."""

    def __init__(self, value: int) -> None:
        self.value = value


def test_atomic_save_leaves_no_temp_and_calls_hook(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    monkeypatch.setattr(io, "post_commit_hook", seen.append)
    target = str(tmp_path / "x.pt")
    io.atomic_save({"w": torch.arange(4.0)}, target)
    io.atomic_write_text("global_step3", str(tmp_path / "latest"))
    assert sorted(os.listdir(tmp_path)) == ["latest", "x.pt"]
    assert seen == [target, str(tmp_path / "latest")]
    assert (tmp_path / "latest").read_text() == "global_step3"  # no trailing newline
    assert torch.equal(io.load_file(target, 0)["w"], torch.arange(4.0))


def test_failed_write_keeps_previous_file(tmp_path: Path) -> None:
    target = str(tmp_path / "x.pt")
    io.atomic_save({"v": 1}, target)

    class Unpicklable:
        def __reduce__(self) -> tuple:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        io.atomic_save({"v": Unpicklable()}, target)
    assert os.listdir(tmp_path) == ["x.pt"]
    assert io.load_file(target, 0) == {"v": 1}


def test_allow_listed_classes_load(tmp_path: Path) -> None:
    import deepspeed.runtime.engine_checkpointing  # noqa: F401 - registers ZeroStageEnum
    from deepspeed.runtime.zero.config import ZeroStageEnum

    scaler = DynamicLossScaler(init_scale=2**10, scale_window=7)
    path = str(tmp_path / "o.pt")
    io.atomic_save({"loss_scaler": scaler, "zero_stage": ZeroStageEnum.gradients, "s": torch.Size([2, 3])}, path)
    back = io.load_file(path, 1)
    assert isinstance(back["loss_scaler"], DynamicLossScaler)
    assert back["loss_scaler"].cur_scale == 2**10 and back["loss_scaler"].scale_window == 7
    assert back["zero_stage"] is ZeroStageEnum.gradients


def test_malicious_pickle_is_refused_and_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = str(tmp_path / "evil.pt")
    torch.save({"module": {}, "payload": Exploit(str(marker))}, path)
    with pytest.raises(io.CheckpointUnsafeError) as info:
        io.load_file(path, 3)
    msg = str(info.value)
    assert path in msg and "rank 3" in msg and "system" in msg and io.TRUST_ENV in msg
    assert not marker.exists()


def test_trusted_opt_out_loads_legacy_objects(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "legacy.pt")
    torch.save({"args": LegacyBlob(5)}, path)
    with pytest.raises(io.CheckpointUnsafeError, match="LegacyBlob"):
        io.load_file(path, 0)
    monkeypatch.setenv(io.TRUST_ENV, "1")
    assert io.LoadTrust.from_env() is io.LoadTrust.TRUSTED
    assert io.load_file(path, 0, io.LoadTrust.from_env())["args"].value == 5


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_corrupt_file_names_file_and_rank(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.zeros(1000)}}, path)
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "garbage": b"not a checkpoint" * 8, "empty": b""}[damage])
    with pytest.raises(io.CheckpointCorruptError) as info:
        io.load_file(str(path), 1)
    assert str(path) in str(info.value) and "rank 1" in str(info.value)


def test_missing_file_and_missing_keys(tmp_path: Path) -> None:
    path = str(tmp_path / "nope.pt")
    with pytest.raises(io.CheckpointFileMissingError, match=r"nope\.pt.*rank 2"):
        io.load_file(path, 2)
    with pytest.raises(io.CheckpointCorruptError, match=r"optimizer_state_dict.*|lacks"):
        io.require_keys({"x": 1}, ["optimizer_state_dict"], path, 0)


def test_clone_tensors_for_torch_save_compacts_views() -> None:
    flat = torch.arange(100.0)
    sd = {"a": flat[:3], "nested": [flat[10:12], (flat[20:21], "keep")], "n": 7}
    out = clone_tensors_for_torch_save(sd)
    assert out["a"].untyped_storage().nbytes() == 3 * 4
    assert torch.equal(out["nested"][0], flat[10:12]) and out["nested"][1][1] == "keep" and out["n"] == 7
    assert out["a"].data_ptr() != flat.data_ptr()
