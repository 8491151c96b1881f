"""``python -m deepspeed.tools.profiling.memory_timeline`` or ``python <this directory>``: the command line."""

from __future__ import annotations

import sys

if __package__:
    from .cli import main
else:  # run as a directory: load the package by path, so another DeepSpeed (or none) may be the importable one
    import importlib.util
    from pathlib import Path

    _HERE = Path(__file__).resolve().parent
    _SPEC = importlib.util.spec_from_file_location(
        "ds_lean_memory_timeline", _HERE / "__init__.py", submodule_search_locations=[str(_HERE)]
    )
    assert _SPEC is not None and _SPEC.loader is not None
    _PACKAGE = importlib.util.module_from_spec(_SPEC)
    sys.modules[_SPEC.name] = _PACKAGE  # the package's relative imports resolve through this entry
    _SPEC.loader.exec_module(_PACKAGE)
    main = _PACKAGE.main

if __name__ == "__main__":
    sys.exit(main())
