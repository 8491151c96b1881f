"""Universal checkpoints, bad input: every failure names the file, executes nothing it reads, changes nothing on
disk, and leaves the engine as it was. Sources are the small upstream-written fixtures (no training needed)."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
import torch

from tests._harness import run_distributed
from tests.reference.models import make_model

UPSTREAM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "upstream")
MARKER = "pwned-marker"


class _Evil:
    """Unpickling this would run a shell command that creates the file ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def _tree_digest(root: str) -> dict[str, str]:
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _convert(tag_dir: str, out: str) -> None:
    from deepspeed.checkpoint.ds_to_universal import main, parse_arguments

    main(parse_arguments(["--input_folder", tag_dir, "--output_folder", out]))


def _copy_case(tmp: str, case: str) -> str:
    dst = os.path.join(tmp, case)
    shutil.copytree(os.path.join(UPSTREAM, case, "global_step2"), dst)
    return dst


# --- converter ------------------------------------------------------------------------------------------------
def test_converter_bad_sources_name_the_file_and_keep_previous_output(tmp_path: object) -> None:
    from deepspeed._core.checkpoint.files import (
        CheckpointCorruptError,
        CheckpointFileMissingError,
        CheckpointUnsafeError,
    )

    tmp = str(tmp_path)
    marker = os.path.join(tmp, MARKER)
    out = os.path.join(tmp, "univ", "u")
    _convert(os.path.join(UPSTREAM, "zero2_fp32_ws2", "global_step2"), out)
    before = _tree_digest(os.path.join(tmp, "univ"))

    src = _copy_case(tmp, "zero2_fp32_ws2")
    rank1 = os.path.join(src, "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    os.remove(rank1)
    with pytest.raises(CheckpointFileMissingError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        _convert(src, out)

    shutil.copy(os.path.join(UPSTREAM, "zero2_fp32_ws2", "global_step2", os.path.basename(rank1)), rank1)
    with open(rank1, "r+b") as f:
        f.truncate(os.path.getsize(rank1) // 2)
    with pytest.raises(CheckpointCorruptError, match=os.path.basename(rank1)):
        _convert(src, out)

    torch.save(_Evil(marker), rank1)
    with pytest.raises(CheckpointUnsafeError, match=os.path.basename(rank1)):
        _convert(src, out)
    assert not os.path.exists(marker), "the crafted pickle was executed"

    assert _tree_digest(os.path.join(tmp, "univ")) == before, "a failed conversion changed the previous output"
    assert sorted(os.listdir(os.path.join(tmp, "univ"))) == ["latest_universal", "u"], "staging folder left behind"


def test_converter_refuses_unsupported_layouts(tmp_path: object) -> None:
    from deepspeed.checkpoint.ds_to_universal import UnsupportedCheckpointError

    tmp = str(tmp_path)
    src = _copy_case(tmp, "zero1_fp32_ws1")
    moe = os.path.join(src, "expp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({}, moe)
    with pytest.raises(UnsupportedCheckpointError, match="MoE expert files"):
        _convert(src, os.path.join(tmp, "o1", "u"))
    os.remove(moe)
    tp = os.path.join(src, "zero_pp_rank_0_mp_rank_01_optim_states.pt")
    torch.save({}, tp)
    with pytest.raises(UnsupportedCheckpointError, match="mp_rank_00"):
        _convert(src, os.path.join(tmp, "o2", "u"))
    os.remove(tp)
    for name in os.listdir(src):
        if name.endswith("optim_states.pt"):
            os.remove(os.path.join(src, name))
    with pytest.raises(UnsupportedCheckpointError, match="stage 1, 2 or 3"):
        _convert(src, os.path.join(tmp, "o3", "u"))
    assert not os.path.exists(os.path.join(tmp, "o1")) and not os.path.exists(os.path.join(tmp, "o3", "u"))


# --- loader -----------------------------------------------------------------------------------------------------
def _snapshot(engine) -> dict:
    out = {f"module.{k}": v.detach().clone() for k, v in engine.module.state_dict().items()}
    out.update({f"master.{i}": g.master.param.detach().clone() for i, g in enumerate(engine.optimizer.groups)})
    inner = engine.optimizer.optimizer.state_dict()["state"]
    out.update({f"state.{g}.{k}": v.clone() for g, s in inner.items() for k, v in s.items() if torch.is_tensor(v)})
    return out


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _load_bad_folders(root: str) -> dict:
    """Rank body (world 1): each damaged copy raises naming its file and leaves the engine unchanged."""
    import deepspeed
    from deepspeed._core.checkpoint.files import (
        CheckpointCorruptError,
        CheckpointFileMissingError,
        CheckpointUnsafeError,
    )

    cfg = {
        "train_micro_batch_size_per_gpu": 3,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "checkpoint": {"load_universal": True},
    }
    engine, *_ = deepspeed.initialize(model=make_model(123), config=cfg)
    before = _snapshot(engine)
    messages = {}
    cases = {
        "missing": CheckpointFileMissingError,
        "truncated": CheckpointCorruptError,
        "crafted": CheckpointUnsafeError,
        "wrong_shape": CheckpointCorruptError,
        "no_latest": ValueError,
    }
    for case, error in cases.items():
        digest = _tree_digest(os.path.join(root, case))
        try:
            engine.load_checkpoint(os.path.join(root, case))
        except error as err:
            messages[case] = str(err)
        assert _tree_digest(os.path.join(root, case)) == digest, case
        assert _same(_snapshot(engine), before), f"{case}: a failed load changed the engine"
    path, _ = engine.load_checkpoint(os.path.join(root, "good"))
    messages["loaded"] = path
    messages["changed"] = not _same(_snapshot(engine), before)
    return messages


def test_loader_bad_folders_change_nothing(tmp_path: object) -> None:
    tmp = str(tmp_path)
    _convert(os.path.join(UPSTREAM, "zero2_fp32_ws1", "global_step2"), os.path.join(tmp, "good", "u"))
    for case in ("missing", "truncated", "crafted", "wrong_shape", "no_latest"):
        shutil.copytree(os.path.join(tmp, "good"), os.path.join(tmp, case))
    zero = lambda case, *p: os.path.join(tmp, case, "u", "zero", *p)  # noqa: E731
    os.remove(zero("missing", "fc1.weight", "exp_avg.pt"))
    with open(zero("truncated", "fc2.bias", "fp32.pt"), "r+b") as f:
        f.truncate(100)
    torch.save(_Evil(os.path.join(tmp, MARKER)), zero("crafted", "norm.weight", "exp_avg_sq.pt"))
    torch.save({"param": torch.zeros(3), "cat_dim": 0}, zero("wrong_shape", "head.weight", "fp32.pt"))
    os.remove(os.path.join(tmp, "no_latest", "latest_universal"))

    got = run_distributed(_load_bad_folders, 1, tmp, timeout=300)[0]
    assert "fc1.weight/exp_avg.pt" in got["missing"], got["missing"]
    assert "fc2.bias/fp32.pt" in got["truncated"], got["truncated"]
    assert "norm.weight/exp_avg_sq.pt" in got["crafted"] and "system" in got["crafted"], got["crafted"]
    assert "head.weight/fp32.pt" in got["wrong_shape"] and "different model" in got["wrong_shape"]
    assert "latest_universal" in got["no_latest"], got["no_latest"]
    assert not os.path.exists(os.path.join(tmp, MARKER)), "the crafted pickle was executed"
    assert got["loaded"].endswith("u") and got["changed"]
