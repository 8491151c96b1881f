"""Convert a ZeRO checkpoint into a universal checkpoint (upstream's command and flags).

``python -m deepspeed.checkpoint.ds_to_universal --input_folder <save_dir>/<tag> --output_folder <dir>``

The result loads at any data-parallel size and ZeRO stage 1-3 with ``"checkpoint": {"load_universal": true}``
(``engine.load_checkpoint(<parent of dir>)`` finds it through ``latest_universal``). The layout and what each
flag does here are described in ``docs/checkpoints.md``; the implementation is
``deepspeed._core.checkpoint.universal``.
"""

from __future__ import annotations

import argparse
from typing import Any

from deepspeed._core.checkpoint.universal import (
    ConvertOptions,
    UnsupportedCheckpointError,
    convert_to_universal,
)
from deepspeed._foundation.logging import logger

__all__ = ["ConvertOptions", "UnsupportedCheckpointError", "main", "parse_arguments"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input_folder", type=str, required=True, help="ZeRO checkpoint folder (<save_dir>/<tag>)")
    parser.add_argument("--output_folder", type=str, required=True, help="universal checkpoint folder to write")
    parser.add_argument("--num_extract_workers", default=4, type=int, help="threads writing the per-parameter files")
    parser.add_argument(
        "--num_merge_workers",
        default=2,
        type=int,
        help="accepted for compatibility: parameters are cut from memory-mapped shards, there is no merge pass",
    )
    parser.add_argument(
        "--keep_temp_folder", action="store_true", help="keep the partial staging folder when the conversion fails"
    )
    parser.add_argument(
        "--no_strict",
        dest="strict",
        action="store_false",
        help="accept shards holding more elements than their parameters (trailing data is ignored)",
    )
    parser.add_argument(
        "--inject_missing_state",
        action="store_true",
        help="accepted for compatibility: universal_checkpoint_info is always added when the source lacks it",
    )
    return parser


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse upstream's command-line flags."""
    return _parser().parse_args(argv)


def main(args: Any) -> str:
    """Run the conversion described by ``args`` (a namespace with the flags' names); returns the output folder."""
    if getattr(args, "num_merge_workers", 2) != 2:
        logger.warning("ds_to_universal: --num_merge_workers has no effect here (there is no merge pass)")
    options = ConvertOptions(
        keep_temp_folder=bool(getattr(args, "keep_temp_folder", False)),
        strict=bool(getattr(args, "strict", True)),
        inject_missing_state=bool(getattr(args, "inject_missing_state", False)),
        num_workers=int(getattr(args, "num_extract_workers", 4)),
    )
    return convert_to_universal(args.input_folder, args.output_folder, options)


if __name__ == "__main__":
    main(parse_arguments())
