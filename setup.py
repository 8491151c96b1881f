"""Build script; the package metadata lives in pyproject.toml.

Two things need code rather than metadata:

* ``csrc/`` sits beside the package (the layout users asked for), so non-editable installs copy it into
  ``deepspeed/ops/csrc`` where the op builders look for sources when JIT-compiling.
* Ahead-of-time op builds follow upstream's convention: ``DS_BUILD_OPS=1`` (or a per-op variable such as
  ``DS_BUILD_CPU_ADAM=1``) compiles the selected ops at install time. That needs torch importable while
  building, so use ``pip install --no-build-isolation .``; without those variables nothing is compiled
  and ops are JIT-built through ninja on first use.
"""

import os
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithSources(build_py):
    """``build_py`` that also ships the C++/CUDA sources inside the package."""

    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "deepspeed" / "ops" / "csrc"
        if (ROOT / "csrc").is_dir():
            shutil.copytree(ROOT / "csrc", target, dirs_exist_ok=True)


def _aot() -> tuple:
    if not any(k.startswith("DS_BUILD_") and v not in ("", "0") for k, v in os.environ.items()):
        return [], {}
    from deepspeed.ops.op_builder.aot import aot_extensions

    return aot_extensions(os.environ)


ext_modules, cmdclass = _aot()
setup(ext_modules=ext_modules, cmdclass={"build_py": BuildPyWithSources, **cmdclass})
