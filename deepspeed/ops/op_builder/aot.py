"""Ahead-of-time builds at install time, with upstream's switches.

``DS_BUILD_OPS=1`` selects every native op that is compatible here; ``DS_BUILD_<OP>=1`` / ``=0``
(each builder's ``BUILD_VAR``) selects or drops one op. These two switches are the only build
environment variables deepspeed-lean reads. A ``setup.py`` uses it as::

    ext_modules, cmdclass = aot_extensions(os.environ)
    setup(ext_modules=ext_modules, cmdclass=cmdclass)

and must run with torch importable (``pip install --no-build-isolation .``). Built modules land at
each builder's ``absolute_name()`` and ``OpBuilder.load()`` imports them instead of JIT-compiling.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from deepspeed.ops.op_builder.all_ops import NATIVE_BUILDERS
from deepspeed.ops.op_builder.builder import OpBuilder


def selected_builders(environ: Mapping[str, str]) -> list[OpBuilder]:
    """Builders chosen by ``DS_BUILD_OPS`` / per-op ``BUILD_VAR``, dropping (with a warning) incompatible ones."""
    build_all = environ.get("DS_BUILD_OPS", "0") == "1"
    chosen = []
    for cls in NATIVE_BUILDERS:
        builder = cls()
        flag = environ.get(builder.BUILD_VAR)
        wanted = flag == "1" if flag is not None else build_all
        if wanted and builder.is_compatible(verbose=True):
            chosen.append(builder)
    return chosen


def aot_extensions(environ: Mapping[str, str]) -> tuple[list[Any], dict[str, Any]]:
    """(ext_modules, cmdclass) for setuptools; both empty when nothing is selected."""
    builders = selected_builders(environ)
    if not builders:
        return [], {}
    from torch.utils.cpp_extension import BuildExtension

    return [b.builder() for b in builders], {"build_ext": BuildExtension}
