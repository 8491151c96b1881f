"""Checkpoints written by upstream DeepSpeed 0.19.x load into our engine and consolidate with our zero_to_fp32.

The fixtures under ``tests/fixtures/upstream/<case>/`` are data produced by upstream (see the README there):
a ``global_step2`` checkpoint of ``make_model(0)`` trained 2 steps, ``expected_fp32.pt`` (upstream's full fp32
masters at the save) and ``expected_step3_fp32.pt`` (upstream's masters after one more step). Checked here:

* our ``get_fp32_state_dict_from_zero_checkpoint`` rebuilds ``expected_fp32`` from upstream's shards;
* our engine, same config and world size, restores the masters and the module weights, ``global_steps == 2``,
  and its next step matches upstream's third step (so the Adam moments and step count were restored too);
* a world-size-2 fixture loads at world size 1 (elastic) and the next step, fed the same global batch through
  gradient accumulation, matches upstream's world-size-2 third step.

Loads run with the default safe (``weights_only``) reader. Upstream's ZeRO-1/2 optimizer files pickle
``deepspeed.utils.tensor_fragment.fragment_address`` (a two-int dataclass in ``param_slice_mappings``); our
package defines it at that path and allow-lists it (``test_upstream_globals_are_ours_and_allowed``).
"""

from __future__ import annotations

import importlib
import json
import os

import pytest
import torch

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "upstream")
CASES = sorted(d for d in os.listdir(FIXTURES) if os.path.isfile(os.path.join(FIXTURES, d, "meta.json")))
ELASTIC = [c for c in CASES if c.endswith("_ws2")]


def _meta(case: str) -> dict:
    with open(os.path.join(FIXTURES, case, "meta.json")) as fd:
        return json.load(fd)


def _expected(case: str, name: str) -> dict[str, torch.Tensor]:
    return torch.load(os.path.join(FIXTURES, case, name), weights_only=True)


def _step3_tolerance(meta: dict) -> dict[str, float]:
    """Bounds far below the step-3 update itself (lr 1e-2), so lost Adam moments or step counts would fail.

    fp32: only the gradient reduction order can differ from upstream (measured: 0 to 1.5e-8 absolute).
    bf16: forward and backward run in bf16 on both sides (measured: up to 1.8e-5 absolute, elastic 2->1).
    """
    return {"rtol": 1e-3, "atol": 1e-4} if meta["bf16"] else {"rtol": 1e-5, "atol": 1e-6}


def test_fixtures_present() -> None:
    assert len(CASES) >= 12, f"expected the upstream fixtures under {FIXTURES}, found {CASES}"
    for case in CASES:
        meta = _meta(case)
        assert meta["deepspeed_version"].startswith("0.19."), (case, meta["deepspeed_version"])
        assert os.path.isfile(os.path.join(FIXTURES, case, "latest"))
        assert not os.path.exists(os.path.join(FIXTURES, case, "zero_to_fp32.py")), "upstream code committed"


def test_upstream_globals_are_ours_and_allowed() -> None:
    """Every class upstream's files pickle resolves in our package and is on our safe-load allow-list."""
    import deepspeed.runtime.engine_checkpointing  # noqa: F401 - registers ZeroStageEnum
    from deepspeed._core.checkpoint import files as checkpoint_io

    allowed = {f"{g.__module__}.{g.__qualname__}" for g in checkpoint_io.safe_globals()}
    problems = set()
    for case in CASES:
        tag_dir = os.path.join(FIXTURES, case, "global_step2")
        for name in sorted(os.listdir(tag_dir)):
            for ref in torch.serialization.get_unsafe_globals_in_checkpoint(os.path.join(tag_dir, name)):
                module, _, attr = ref.rpartition(".")
                if ref not in allowed or not hasattr(importlib.import_module(module), attr):
                    problems.add(ref)
    assert not problems, f"upstream checkpoints reference classes we cannot safely rebuild: {sorted(problems)}"


@pytest.mark.parametrize("case", CASES)
def test_zero_to_fp32_consolidates_upstream(case: str) -> None:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    got = get_fp32_state_dict_from_zero_checkpoint(os.path.join(FIXTURES, case))
    expected = _expected(case, "expected_fp32.pt")
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        assert got[name].dtype == torch.float32, name
        torch.testing.assert_close(got[name], value, rtol=1e-6, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def _full_fp32(engine, meta: dict) -> dict[str, torch.Tensor] | None:
    """Every parameter's full fp32 master; ``None`` on ranks > 0 when it comes from the ZeRO-3 fallback."""
    from deepspeed.utils import safe_get_full_fp32_param

    full = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    if all(v is not None for v in full.values()):
        return {n: v.detach().float().cpu().clone() for n, v in full.items()}
    # Our safe_get_full_fp32_param does not answer for ZeRO-3 parameters yet; in an fp32 run the consolidated
    # module weights are the masters themselves (written back after every step and after loading).
    assert meta["zero_stage"] == 3 and not meta["bf16"], "safe_get_full_fp32_param returned None"
    return engine._zero3_consolidated_16bit_state_dict()


def _module_weights(engine, stage: int) -> dict[str, torch.Tensor] | None:
    if stage == 3:
        return engine._zero3_consolidated_16bit_state_dict()
    return {k: v.detach().cpu().clone() for k, v in engine.module.state_dict().items()}


def _load_and_step(case_dir: str, meta: dict, world: int) -> dict:
    """Rank body: fresh engine (different init), load upstream's checkpoint, record, train step 3, record."""
    import deepspeed
    from deepspeed import comm as dist

    gas = meta["world_size"] // world  # keep upstream's global batch: micro_batch(2, i) for i < saved world
    config = dict(meta["config"], gradient_accumulation_steps=gas)
    engine, *_ = deepspeed.initialize(model=make_model(123), config=config)
    path, client_state = engine.load_checkpoint(case_dir)
    out = {
        "path": path,
        "global_steps": engine.global_steps,
        "masters": _full_fp32(engine, meta),
        "module": _module_weights(engine, meta["zero_stage"]),
        "ds_version": client_state.get("ds_version"),
    }
    rank = dist.get_rank()
    for m in range(gas):
        loss = engine(*micro_batch(2, m * world + rank))
        engine.backward(loss)
        engine.step()
    out["after"] = _full_fp32(engine, meta)
    out["global_steps_after"] = engine.global_steps
    return out


def _check(case: str, results: list[dict]) -> None:
    meta = _meta(case)
    expected = _expected(case, "expected_fp32.pt")
    step3 = _expected(case, "expected_step3_fp32.pt")
    dtype = torch.bfloat16 if meta["bf16"] else torch.float32
    for rank, res in enumerate(results):
        assert res["path"] is not None and res["path"].endswith("global_step2"), res["path"]
        assert res["global_steps"] == 2 and res["global_steps_after"] == 3, (res["global_steps"], rank)
        assert res["ds_version"] == meta["deepspeed_version"]
        if res["masters"] is not None:  # None on ranks > 0 for the ZeRO-3 fallback in _full_fp32
            assert sorted(res["masters"]) == sorted(expected)
            for name, value in expected.items():
                torch.testing.assert_close(
                    res["masters"][name],
                    value,
                    rtol=1e-6,
                    atol=0,
                    msg=lambda m, n=name, r=rank: f"master {n} rank {r}: {m}",
                )
                torch.testing.assert_close(
                    res["after"][name],
                    step3[name],
                    **_step3_tolerance(meta),
                    msg=lambda m, n=name, r=rank: f"step 3 {n} rank {r}: {m}",
                )
        if res["module"] is not None:  # ZeRO-3 consolidates on rank 0 only
            assert sorted(res["module"]) == sorted(expected)
            for name, value in expected.items():
                assert res["module"][name].dtype == dtype, name
                torch.testing.assert_close(
                    res["module"][name], value.to(dtype), rtol=0, atol=0, msg=lambda m, n=name: f"module {n}: {m}"
                )
    assert results[0]["module"] is not None and results[0]["masters"] is not None


@pytest.mark.parametrize("case", CASES)
def test_engine_loads_upstream(case: str) -> None:
    meta = _meta(case)
    world = meta["world_size"]
    _check(case, run_distributed(_load_and_step, world, os.path.join(FIXTURES, case), meta, world))


@pytest.mark.parametrize("case", ELASTIC)
def test_engine_loads_upstream_elastic(case: str) -> None:
    meta = _meta(case)
    assert meta["world_size"] == 2
    _check(case, run_distributed(_load_and_step, 1, os.path.join(FIXTURES, case), meta, 1))


def _load_refused(case_dir: str, meta: dict) -> dict:
    """Rank body: loading must raise on every rank and leave the module and masters as they were."""
    import deepspeed

    engine, *_ = deepspeed.initialize(model=make_model(123), config=meta["config"])
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    masters = _full_fp32(engine, meta)
    try:
        engine.load_checkpoint(case_dir)
    except ValueError as err:
        error = str(err)
    else:
        error = ""
    unchanged = all(torch.equal(v, before[k]) for k, v in engine.module.state_dict().items())
    masters_kept = all(torch.equal(v, masters[k]) for k, v in _full_fp32(engine, meta).items())
    return {"error": error, "unchanged": unchanged and masters_kept}


def _aligned_copy(case: str, tmp_path) -> str:
    """A copy of ``case`` whose rank-1 shard claims a padding after the second parameter (parameter_alignment)."""
    import shutil

    import deepspeed.runtime.engine_checkpointing  # noqa: F401 - registers ZeroStageEnum for safe loading
    from deepspeed._core.checkpoint import files as checkpoint_io

    folder = tmp_path / case
    shutil.copytree(os.path.join(FIXTURES, case), folder)
    shard = folder / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    state = checkpoint_io.load_file(str(shard), 0, checkpoint_io.LoadTrust.SAFE)
    paddings = state["optimizer_state_dict"]["param_alignment_paddings"]
    assert paddings and not any(any(g) for g in paddings), paddings  # upstream's files: all zero
    paddings[0][1] = 4
    torch.save(state, shard)
    return str(folder)


def test_parameter_aligned_shards_are_refused(tmp_path) -> None:
    """A file saved with upstream's parameter_alignment (non-zero ``param_alignment_paddings``) pads between
    parameters; it is refused on every rank, naming the key, before the engine changes."""
    folder = _aligned_copy("zero2_fp32_ws2", tmp_path)
    results = run_distributed(_load_refused, 2, folder, _meta("zero2_fp32_ws2"))
    for res in results:
        assert "param_alignment_paddings" in res["error"] and "parameter_alignment" in res["error"], res["error"]
        assert res["unchanged"]


def test_parameter_aligned_shards_are_refused_by_zero_to_fp32_and_the_converter(tmp_path) -> None:
    from deepspeed._core.checkpoint.universal import UnsupportedCheckpointError
    from deepspeed.checkpoint.ds_to_universal import main, parse_arguments
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder = _aligned_copy("zero2_fp32_ws2", tmp_path)
    with pytest.raises(ValueError, match="param_alignment_paddings"):
        get_fp32_state_dict_from_zero_checkpoint(folder)
    out = str(tmp_path / "univ" / "u")
    with pytest.raises(UnsupportedCheckpointError, match="param_alignment_paddings"):
        main(parse_arguments(["--input_folder", os.path.join(folder, "global_step2"), "--output_folder", out]))
    assert not os.path.exists(out)
