"""examples/pipeline_gpt.py runs as documented (two pipeline stages over gloo) and trains."""

from __future__ import annotations

from tests._harness import run_distributed


def _run_example(argv: list[str]) -> int:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "pipeline_gpt.py"
    spec = importlib.util.spec_from_file_location("pipeline_gpt_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example.main(argv)


def test_example_trains_on_two_stages() -> None:
    """examples/pipeline_gpt.py with the report's config (fp16, ZeRO-1, partitioned checkpointing): loss goes down."""
    from pathlib import Path

    config = str(Path(__file__).resolve().parents[2] / "examples" / "ds_config_pipeline_neox.json")
    argv = [
        "--deepspeed_config",
        config,
        "--gas",
        "2",
        "--steps",
        "8",
        "--lr",
        "3e-3",
        "--layers",
        "2",
        "--hidden",
        "32",
        "--seq",
        "16",
    ]
    assert run_distributed(_run_example, 2, argv, timeout=120) == [0, 0]
