"""Checkpoints written here have the layout upstream DeepSpeed 0.19.8 writes, so upstream can load them.

For every fixture under ``tests/fixtures/upstream/<case>/`` (written by upstream, see the README there) our engine
trains the same model with the same config at the same world size for the same two steps and saves. The two
``global_step2`` folders must then hold the same file names, and every file the same *skeleton*: the same dict
keys and list lengths all the way down, the same container and leaf types, and tensors of the same shapes and
dtypes; pickled objects (loss scaler, ``fragment_address``) the same class and attributes. Values are not
compared here (``test_upstream_interop.py`` checks what they mean). Outside the tag folder upstream 0.19.8 also
copies a second script, ``zero_to_torch.py``, which this package does not write (see docs/checkpoints.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests._harness import run_distributed
from tests.reference.models import make_model, micro_batch

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "upstream")
CASES = sorted(d for d in os.listdir(FIXTURES) if os.path.isfile(os.path.join(FIXTURES, d, "meta.json")))
TAG = "global_step2"


def _meta(case: str) -> dict:
    with open(os.path.join(FIXTURES, case, "meta.json")) as fd:
        return json.load(fd)


def skeleton(obj: Any) -> Any:
    """``obj`` with every value replaced by its form: tensors by shape and dtype, other leaves by type name,
    objects by class and attributes."""
    if torch.is_tensor(obj):
        return ("tensor", tuple(obj.shape), str(obj.dtype))
    if isinstance(obj, dict):
        return {key: skeleton(value) for key, value in obj.items()}
    if isinstance(obj, torch.Size):
        return ("Size", len(obj))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, [skeleton(v) for v in obj])
    if isinstance(obj, (set, frozenset)):
        return (type(obj).__name__, len(obj))
    if isinstance(obj, (bool, int, float, str, type(None))):
        return type(obj).__name__  # an int-Enum such as ZeroStageEnum keeps its own name
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    # Pickled objects (loss scaler, fragment_address): the reader sees their attributes, so those count too.
    return (kind, skeleton(vars(obj))) if hasattr(obj, "__dict__") else kind


def differences(ours: Any, theirs: Any, path: str = "") -> Iterator[str]:
    """Human-readable differences between two skeletons, each prefixed with its path."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in sorted(set(ours) | set(theirs), key=repr):
            where = f"{path}/{key!r}"
            if key not in theirs:
                yield f"{where}: only ours has it"
            elif key not in ours:
                yield f"{where}: only upstream's has it"
            else:
                yield from differences(ours[key], theirs[key], where)
        return
    seqs = all(isinstance(s, tuple) and len(s) == 2 and isinstance(s[1], list) for s in (ours, theirs))
    if seqs and ours[0] == theirs[0] and len(ours[1]) == len(theirs[1]):
        for index, (a, b) in enumerate(zip(ours[1], theirs[1])):
            yield from differences(a, b, f"{path}[{index}]")
        return
    if ours != theirs:
        yield f"{path}: ours {_short(ours)} != upstream {_short(theirs)}"


def _short(form: Any) -> str:
    text = repr(form)
    return text if len(text) < 160 else text[:157] + "..."


def _save_like_upstream(save_dir: str, meta: dict) -> None:
    """Rank body: the fixture's training run (same model, config, data, steps), saved with our engine."""
    import deepspeed
    from deepspeed import comm as dist

    engine, *_ = deepspeed.initialize(model=make_model(0), config=meta["config"])
    for step in range(meta["steps_before_save"]):
        loss = engine(*micro_batch(step, dist.get_rank()))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(save_dir)


def _load(path: str) -> Any:
    import deepspeed.runtime.engine_checkpointing  # noqa: F401 - registers ZeroStageEnum for safe loading
    from deepspeed._core.checkpoint import files as checkpoint_io

    return checkpoint_io.load_file(path, 0, checkpoint_io.LoadTrust.SAFE)


def _file_differences(ours_dir: str, theirs_dir: str) -> list[str]:
    problems = []
    ours_files, theirs_files = sorted(os.listdir(ours_dir)), sorted(os.listdir(theirs_dir))
    if ours_files != theirs_files:
        problems.append(f"file names: ours {ours_files} != upstream {theirs_files}")
    for name in sorted(set(ours_files) & set(theirs_files)):
        ours, theirs = skeleton(_load(os.path.join(ours_dir, name))), skeleton(_load(os.path.join(theirs_dir, name)))
        problems += [f"{name}{d}" for d in differences(ours, theirs)]
    return problems


@pytest.mark.parametrize("case", CASES)
def test_our_checkpoint_has_upstream_layout(case: str, tmp_path) -> None:
    meta = _meta(case)
    run_distributed(_save_like_upstream, meta["world_size"], str(tmp_path), meta)
    assert (tmp_path / "latest").read_text() == TAG
    assert (tmp_path / "zero_to_fp32.py").is_file()
    problems = _file_differences(str(tmp_path / TAG), os.path.join(FIXTURES, case, TAG))
    assert not problems, f"{case}: our checkpoint's layout differs from upstream's:\n" + "\n".join(problems)


def test_skeleton_catches_a_layout_change() -> None:
    """The comparison itself sees a missing key, a changed shape, a changed dtype and a changed leaf type."""
    base = {"a": torch.zeros(2, 3), "b": [1, {"c": torch.Size([4])}], "d": None}
    assert not list(differences(skeleton(base), skeleton(dict(base))))
    variants = [
        {k: v for k, v in base.items() if k != "d"},
        dict(base, a=torch.zeros(3, 2)),
        dict(base, a=torch.zeros(2, 3, dtype=torch.bfloat16)),
        dict(base, b=[1, {"c": [4]}]),
        dict(base, b=[1.0, {"c": torch.Size([4])}]),
        dict(base, b=[1]),
    ]
    for variant in variants:
        assert list(differences(skeleton(variant), skeleton(base))), variant
