"""zero_to_fp32 against hand-built ZeRO-1/2/3 checkpoints in upstream's layout (world sizes 1-3)."""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from deepspeed.utils import zero_to_fp32 as z
from tests.unit.checkpoint.synthetic import expected_state, make_net, write_stage3, write_stage12


def _assert_state_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], tensor), name


def _build(root: str, stage: int, world: int, strip: bool = True) -> torch.nn.Module:
    net = make_net(world * 10 + stage)
    if stage == 3:
        write_stage3(root, net, world)
    else:
        write_stage12(root, net, stage, world, strip)
    return net


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("stage,strip", [(1, True), (2, True), (2, False), (3, True)])
def test_consolidates_to_original_fp32(tmp_path: Path, stage: int, world: int, strip: bool) -> None:
    net = _build(str(tmp_path), stage, world, strip)
    got = z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    # Stage 1 records no frozen parameters (upstream layout), stages 2-3 do.
    _assert_state_equal(got, expected_state(net, include_frozen=stage >= 2))
    assert got["head.weight"] is got["embed.weight"]  # tied weights stay tied
    if stage >= 2:
        excluded = z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), exclude_frozen_parameters=True)
        assert not any(k.startswith("frozen.") for k in excluded)


@pytest.mark.parametrize("stage", [2, 3])
def test_lazy_mode_and_explicit_tag(tmp_path: Path, stage: int) -> None:
    net = _build(str(tmp_path), stage, 3)
    (tmp_path / "latest").unlink()
    with pytest.raises(ValueError, match="latest"):
        z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))
    lazy = z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="global_step3", lazy_mode=True)
    assert isinstance(lazy["mid.weight"], z.GatheredTensor) and lazy["mid.weight"].shape == net.mid.weight.shape
    got = {k: (v.contiguous() if isinstance(v, z.GatheredTensor) else v) for k, v in lazy.items()}
    _assert_state_equal(got, expected_state(net, include_frozen=True))


def test_convert_single_file_and_load_into_model(tmp_path: Path) -> None:
    net = _build(str(tmp_path / "ckpt"), 2, 2)
    out = tmp_path / "out"
    z.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(out))
    assert sorted(os.listdir(out)) == ["pytorch_model.bin"]
    _assert_state_equal(torch.load(out / "pytorch_model.bin", weights_only=True), expected_state(net, True))
    fresh = make_net(99)
    loaded = z.load_state_dict_from_zero_checkpoint(fresh, str(tmp_path / "ckpt"))
    assert torch.equal(loaded.mid.weight.float(), net.mid.weight.float())


def test_convert_sharded_with_index(tmp_path: Path) -> None:
    net = _build(str(tmp_path / "ckpt"), 3, 2)
    out = tmp_path / "out"
    z.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(out), max_shard_size="200B")
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    shards = sorted(f for f in os.listdir(out) if f.endswith(".bin"))
    assert len(shards) > 2 and shards[0] == f"pytorch_model-00001-of-{len(shards):05d}.bin"
    merged: dict = {}
    for shard in shards:
        part = torch.load(out / shard, weights_only=True)
        assert all(index["weight_map"][k] == shard for k in part)
        merged.update(part)
    assert set(index["weight_map"]) == set(merged)
    _assert_state_equal(merged, expected_state(net, True))
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in merged.values())


def test_safetensors_output_or_clear_error(tmp_path: Path) -> None:
    net = _build(str(tmp_path / "ckpt"), 1, 2)
    try:
        import safetensors.torch as st
    except ImportError:
        with pytest.raises(ImportError, match="safetensors"):
            z.convert_zero_checkpoint_to_fp32_state_dict(
                str(tmp_path / "ckpt"), str(tmp_path / "o"), safe_serialization=True
            )
        return
    z.convert_zero_checkpoint_to_fp32_state_dict(str(tmp_path / "ckpt"), str(tmp_path / "o"), safe_serialization=True)
    _assert_state_equal(st.load_file(str(tmp_path / "o" / "model.safetensors")), expected_state(net, False))


def test_mismatched_rank_count_is_reported(tmp_path: Path) -> None:
    _build(str(tmp_path), 2, 3)
    tag_dir = tmp_path / "global_step3"
    (tag_dir / "zero_pp_rank_2_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(ValueError, match="expected 3 optimizer files"):
        z.get_fp32_state_dict_from_zero_checkpoint(str(tmp_path))


def test_parse_size() -> None:
    assert z.parse_size("5GB") == 5 * 10**9 and z.parse_size("2MiB") == 2 * 2**20 and z.parse_size(17) == 17
    with pytest.raises(ValueError, match="max_shard_size"):
        z.parse_size("lots")


def test_cli_as_standalone_script(tmp_path: Path) -> None:
    """The copy placed in checkpoint folders runs as a plain script with upstream's flags."""
    net = _build(str(tmp_path / "ckpt"), 3, 3)
    script = tmp_path / "ckpt" / "zero_to_fp32.py"
    script.write_text(Path(z.__file__).read_text())
    out = tmp_path / "out"
    argv = [
        str(script),
        str(tmp_path / "ckpt"),
        str(out),
        "-t",
        "global_step3",
        "--exclude_frozen_parameters",
        "--max_shard_size",
        "5GB",
    ]
    # Run the copy as __main__ from its own path (not as deepspeed.utils.zero_to_fp32), as users do.
    with mock.patch.object(sys, "argv", argv):
        runpy.run_path(str(script), run_name="__main__")
    got = torch.load(out / "pytorch_model.bin", weights_only=True)
    _assert_state_equal(got, expected_state(net, include_frozen=False))
