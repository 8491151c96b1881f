"""``OpBuilder``: how one native op is described, checked, built ahead of time or JIT-loaded.

A builder names its sources, include paths and compiler flags; the base class turns those into a
``torch.utils.cpp_extension`` JIT build (ninja, cached in ``TORCH_EXTENSIONS_DIR``) or into a
setuptools extension for an ahead-of-time build. ``load()`` prefers a prebuilt module
(``absolute_name()``), then the JIT cache, then compiles.

Build behaviour is decided by what is installed (compiler, ninja, a CUDA toolkit, a CUDA torch),
not by environment variables; only the standard ``CXX`` / ``TORCH_EXTENSIONS_DIR`` /
``TORCH_CUDA_ARCH_LIST`` that torch itself reads apply.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import shutil
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import torch

from deepspeed._foundation.logging import logger


def csrc_root() -> Path:
    """Directory holding the C++/CUDA sources: ``<repo>/csrc`` in a checkout, else ``deepspeed/ops/csrc``."""
    package_dir = Path(__file__).resolve().parents[2]
    for candidate in (package_dir.parent / "csrc", package_dir / "ops" / "csrc"):
        if candidate.is_dir():
            return candidate
    return package_dir.parent / "csrc"


def _resolve(paths: list[str]) -> list[str]:
    """Absolute paths for builder-relative ``csrc/...`` paths."""
    root = csrc_root()
    return [str(root / Path(p).relative_to("csrc")) if p.startswith("csrc/") else p for p in paths]


@dataclasses.dataclass(frozen=True)
class OpStatus:
    """What ``ds_report`` shows for one op."""

    name: str
    compatible: bool
    built: bool
    reasons: tuple[str, ...]


class OpBuilder:
    """Base builder: subclasses set ``NAME``/``BUILD_VAR`` and override ``sources()`` and flags."""

    NAME: str = "op"
    BUILD_VAR: str = "DS_BUILD_OP"
    _loaded: ClassVar[dict[str, ModuleType]] = {}
    _lock = threading.Lock()

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME
        self.error_log: str | None = None
        self.jit_mode = False

    # ----- description (override in subclasses) -----
    def absolute_name(self) -> str:
        """Import path of an ahead-of-time built module, e.g. ``deepspeed.ops.adam.cpu_adam_op``."""
        return f"deepspeed.ops.{self.name}_op"

    def sources(self) -> list[str]:
        """Source files, relative to the repository (``csrc/...``)."""
        raise NotImplementedError(f"{type(self).__name__} does not list its sources")

    def include_paths(self) -> list[str]:
        """Extra include directories (``csrc/...`` relative paths are resolved)."""
        return ["csrc/includes"]

    def cxx_args(self) -> list[str]:
        """Host compiler flags (torch adds the C++ standard it was built with)."""
        return ["-O3", "-g0"]

    def nvcc_args(self) -> list[str]:
        """CUDA compiler flags (unused by CPU-only builders)."""
        return []

    def extra_ldflags(self) -> list[str]:
        """Linker flags."""
        return []

    def uses_cuda(self) -> bool:
        """True when this build compiles CUDA sources."""
        return False

    # ----- checks -----
    @staticmethod
    def command_exists(cmd: str) -> bool:
        """True when ``cmd`` is on ``PATH``."""
        return shutil.which(cmd) is not None

    def incompatibility_reasons(self) -> list[str]:
        """Why this op cannot be built here (empty when it can)."""
        reasons = []
        compiler = os.environ.get("CXX", "c++")
        if not self.command_exists(compiler):
            reasons.append(f"no C++ compiler ({compiler!r} not on PATH)")
        from torch.utils.cpp_extension import is_ninja_available

        if not is_ninja_available():
            reasons.append("ninja is not installed (pip install ninja)")
        missing = [p for p in _resolve(self.sources()) if not os.path.isfile(p)]
        if missing:
            reasons.append(f"sources not found: {missing[0]}")
        return reasons

    def is_compatible(self, verbose: bool = False) -> bool:
        """True when this op can be built (and so loaded) on this machine."""
        reasons = self.incompatibility_reasons()
        self.error_log = "; ".join(reasons) or None
        if reasons and verbose:
            logger.warning(f"{self.name} is not compatible: {self.error_log}")
        return not reasons

    # ----- build and load -----
    def _build_kwargs(self) -> dict[str, Any]:
        return {
            "sources": _resolve(self.sources()),
            "include_dirs": _resolve(self.include_paths()),
            "extra_compile_args": {"cxx": self.cxx_args(), "nvcc": self.nvcc_args()},
            "extra_link_args": self.extra_ldflags(),
        }

    def builder(self) -> Any:
        """A setuptools extension for an ahead-of-time build (``DS_BUILD_OPS=1 pip install .``)."""
        from torch.utils import cpp_extension

        kwargs = self._build_kwargs()
        if self.uses_cuda():
            return cpp_extension.CUDAExtension(name=self.absolute_name(), **kwargs)
        kwargs["extra_compile_args"] = kwargs["extra_compile_args"]["cxx"]
        return cpp_extension.CppExtension(name=self.absolute_name(), **kwargs)

    def prebuilt_module(self) -> ModuleType | None:
        """The ahead-of-time built module, or ``None`` when it is not installed."""
        try:
            return importlib.import_module(self.absolute_name())
        except ImportError:
            return None

    def load(self, verbose: bool = False) -> ModuleType:
        """The op's module: prebuilt if installed, else JIT-compiled (and cached)."""
        with OpBuilder._lock:
            module = OpBuilder._loaded.get(self.name)
            if module is None:
                module = self.prebuilt_module() or self.jit_load(verbose)
                OpBuilder._loaded[self.name] = module
        return module

    def jit_load(self, verbose: bool = False) -> ModuleType:
        """Compile with ninja through ``torch.utils.cpp_extension.load`` (cached per source hash)."""
        if not self.is_compatible(verbose):
            raise RuntimeError(f"Unable to JIT load the {self.name} op: {self.error_log}")
        from torch.utils.cpp_extension import load

        self.jit_mode = True
        kwargs = self._build_kwargs()
        start = time.time()
        module = load(
            name=self.name,
            sources=kwargs["sources"],
            extra_include_paths=kwargs["include_dirs"],
            extra_cflags=self.cxx_args(),
            extra_cuda_cflags=self.nvcc_args(),
            extra_ldflags=self.extra_ldflags(),
            with_cuda=self.uses_cuda(),
            verbose=verbose,
        )
        logger.info(f"Loading extension module {self.name} took {time.time() - start:.1f} s")
        return module

    # ----- reporting -----
    def jit_cached(self) -> bool:
        """True when a JIT build of this op is present in the torch extensions cache."""
        from torch.utils.cpp_extension import get_default_build_root

        root = Path(get_default_build_root())
        return any(root.glob(f"*/{self.name}*/{self.name}*.so")) or any(root.glob(f"{self.name}*/{self.name}*.so"))

    def is_built(self) -> bool:
        """True when the op is loaded, installed ahead of time, or present in the JIT cache."""
        if self.name in OpBuilder._loaded:
            return True
        return self.prebuilt_module() is not None or self.jit_cached()

    def status(self) -> OpStatus:
        """Compatibility, build state and reasons, for ``ds_report``."""
        reasons = tuple(self.incompatibility_reasons())
        return OpStatus(self.name, not reasons, self.is_built(), reasons)


def find_nvcc() -> str | None:
    """The CUDA compiler: the one in torch's ``CUDA_HOME`` when torch found a toolkit, else ``nvcc`` on PATH.

    ``ds_report`` and the builders' compatibility checks both ask this one function, so they agree.
    """
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME:
        return os.path.join(CUDA_HOME, "bin", "nvcc")
    return shutil.which("nvcc")


class CUDAOpBuilder(OpBuilder):
    """Builder of an op with CUDA sources. ``CUDA_REQUIRED = False`` ops build CPU-only without CUDA."""

    CUDA_REQUIRED: bool = True

    def cuda_reasons(self) -> list[str]:
        """Why CUDA sources cannot be compiled here (empty when they can)."""
        from torch.utils.cpp_extension import CUDA_HOME

        nvcc = find_nvcc()
        if torch.version.cuda is None:
            found = f"; the CUDA toolkit at {nvcc} needs a CUDA build of torch" if nvcc else ""
            return [f"this torch build has no CUDA{found}"]
        if CUDA_HOME is None:
            # torch's extension builder compiles with the toolkit it found itself, not with any nvcc on PATH.
            return ["torch found no CUDA toolkit (set CUDA_HOME)" + (f"; nvcc on PATH: {nvcc}" if nvcc else "")]
        return []

    def uses_cuda(self) -> bool:
        """True when the CUDA sources can be compiled here."""
        return not self.cuda_reasons()

    def incompatibility_reasons(self) -> list[str]:
        """Base checks plus, when CUDA is required, the CUDA checks."""
        reasons = super().incompatibility_reasons()
        if self.CUDA_REQUIRED:
            reasons.extend(self.cuda_reasons())
        return reasons

    def cpp_sources(self) -> list[str]:
        """Host sources, always compiled."""
        return []

    def cuda_sources(self) -> list[str]:
        """The ``.cu`` files, compiled only when ``uses_cuda()``."""
        return []

    def sources(self) -> list[str]:
        """Host sources, plus the CUDA sources when they can be compiled."""
        return self.cpp_sources() + (self.cuda_sources() if self.uses_cuda() else [])

    def cxx_args(self) -> list[str]:
        """Host flags, plus ``-DDS_WITH_CUDA`` when the CUDA sources are compiled."""
        return super().cxx_args() + (["-DDS_WITH_CUDA"] if self.uses_cuda() else [])

    def nvcc_args(self) -> list[str]:
        """nvcc flags; torch adds the ``-gencode`` flags (``TORCH_CUDA_ARCH_LIST`` or the visible GPUs)."""
        return ["-O3", "-lineinfo", "-DDS_WITH_CUDA"]
