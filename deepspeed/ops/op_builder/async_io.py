"""``AsyncIOBuilder``: the asynchronous file I/O op behind NVMe offload (``aio_handle``).

The op always has a thread-pool backend (blocking ``pread``/``pwrite`` calls, ``min(queue_depth, 16)`` threads
per worker so that as many requests are in flight). When the libaio development headers and library are found at
build time it also compiles the kernel-AIO backend, which keeps up to ``queue_depth`` requests in flight per worker
from one thread; ``aio_handle(backend="auto")`` then uses it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from functools import lru_cache

from deepspeed.ops.op_builder.builder import OpBuilder

LIBAIO_WARNING = "async_io requires the dev libaio .so object and headers but these were not found."
LIBAIO_HINT = "async_io: please install the libaio-dev package with apt"


@lru_cache(maxsize=1)
def libaio_available() -> bool:
    """True when a program using ``io_submit`` compiles and links against libaio here (headers and library)."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return False
    source = "#include <libaio.h>\nint main() { io_context_t c = 0; io_setup(1, &c); return io_submit(c, 0, 0); }\n"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.cpp")
        with open(src, "w") as handle:
            handle.write(source)
        cflags = os.environ.get("CFLAGS", "").split()
        ldflags = os.environ.get("LDFLAGS", "").split()
        cmd = [compiler, *cflags, src, "-o", os.path.join(tmp, "probe"), *ldflags, "-laio"]
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=60, check=False)
        except (OSError, subprocess.SubprocessError):
            return False
    return done.returncode == 0


class AsyncIOBuilder(OpBuilder):
    """Builds ``csrc/aio/ds_aio.cpp`` (module ``aio_handle``, ``aio_read``, ``aio_write``, ``deepspeed_memcpy``)."""

    BUILD_VAR = "DS_BUILD_AIO"
    NAME = "async_io"

    def __init__(self) -> None:
        super().__init__(name=self.NAME)

    def absolute_name(self) -> str:
        """Import path of the ahead-of-time build."""
        return f"deepspeed.ops.aio.{self.NAME}_op"

    def sources(self) -> list[str]:
        """The single C++ source."""
        return ["csrc/aio/ds_aio.cpp"]

    def cxx_args(self) -> list[str]:
        """``-DDS_AIO_HAVE_LIBAIO`` when libaio is usable here (the kernel-AIO backend is compiled in)."""
        return super().cxx_args() + (["-DDS_AIO_HAVE_LIBAIO"] if libaio_available() else [])

    def extra_ldflags(self) -> list[str]:
        """``-laio`` with the libaio backend; threads either way."""
        return (["-laio"] if libaio_available() else []) + ["-lpthread"]

    def backend(self) -> str:
        """The backend ``aio_handle(backend="auto")`` uses when built here: ``libaio`` or ``threads``."""
        return "libaio" if libaio_available() else "threads"

    def warnings(self) -> list[str]:
        """``ds_report`` lines when libaio is missing (the thread-pool backend still builds)."""
        if libaio_available():
            return []
        hint = "if libaio is installed elsewhere, set CFLAGS and LDFLAGS to its include and lib directories"
        return [LIBAIO_WARNING, LIBAIO_HINT, hint]
