"""Upstream DeepSpeed as a baseline: prepared here as files, installed on the GPU machine into its own directory.

The scenarios drive upstream through the very same code as ours (``deepspeed.initialize``, ``engine.backward``,
``engine.step``); only PYTHONPATH differs, so ``import deepspeed`` finds upstream's package in its target
directory instead of this repository. The GPU machine has no registry access, so:

1. here (with a registry), once::

       python benchmarks/baselines/upstream.py prepare      # -> .whl_upstream/deepspeed-0.19.8-py3-none-any.whl

   which runs ``pip download --no-deps --no-binary :all: deepspeed==0.19.8`` (the sdist has no pyproject.toml,
   it is a plain setup.py build) and ``DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation`` on it: no op is
   compiled, the result is a pure-Python wheel. Its pure-Python needs (hjson, msgpack, einops, tqdm, py-cpuinfo,
   ninja, pydantic, psutil, packaging, numpy, nvidia-ml-py) are already in the GPU image except hjson and
   pydantic (+ pydantic-core, annotated-types, typing-inspection, typing-extensions), which our own engine needs
   too: ``prepare`` downloads them, at the versions installed here, as CPython 3.12 x86-64 wheels into
   ``.whl_upstream/site/`` (what ``benchmarks/device_run.sh`` installs first). ``.whl_upstream/`` is git-ignored
   (``.git/info/exclude``).
2. there::

       python benchmarks/baselines/upstream.py install --target /tmp/upstream_ds
       # = pip install --no-index --no-deps --no-compile --target /tmp/upstream_ds .whl_upstream/deepspeed-*.whl

   and the workers run with ``PYTHONPATH=/tmp/upstream_ds:<site of .whl>`` (see ``worker_env``). Upstream
   JIT-compiles ops only when one is used; the scenarios pass a torch AdamW, so none is built.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
from pathlib import Path

UPSTREAM_VERSION = "0.19.8"
REPO = Path(__file__).resolve().parents[2]
WHEEL_DIR = REPO / ".whl_upstream"
DEFAULT_TARGET = "/tmp/upstream_ds"


def prepare(dl_dir: str = "/tmp/upstream_sdist") -> Path:
    """Download the sdist and build the no-ops wheel into ``.whl_upstream/`` (needs a registry and torch)."""
    WHEEL_DIR.mkdir(exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run(
        pip + ["download", "--no-deps", "--no-binary", ":all:", f"deepspeed=={UPSTREAM_VERSION}", "-d", dl_dir],
        check=True,
    )
    sdist = glob.glob(os.path.join(dl_dir, f"deepspeed-{UPSTREAM_VERSION}.tar.gz"))[0]
    # Without build isolation the setup.py build needs `wheel` installed here (a fresh environment lacks it).
    subprocess.run(pip + ["install", "-q", "wheel"], check=True)
    env = dict(os.environ, DS_BUILD_OPS="0")
    subprocess.run(
        pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(WHEEL_DIR), sdist], check=True, env=env
    )
    prepare_site()
    return wheel_path()


SITE_PACKAGES = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions", "hjson")
"""What the GPU image lacks of what both engines import, carried as wheels in ``.whl_upstream/site/``."""

GPU_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def prepare_site(python_version: str = "3.12") -> Path:
    """Download :data:`SITE_PACKAGES`, at the versions installed here, as wheels for the GPU machine's Python
    (and pytest-timeout into ``.whl_upstream/tests/``)."""
    from importlib import metadata

    site = WHEEL_DIR / "site"
    site.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={metadata.version(name)}" for name in SITE_PACKAGES]
    platforms = [arg for platform in GPU_PLATFORMS for arg in ("--platform", platform)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
        + ["--python-version", python_version, "--implementation", "cp", *platforms, "-d", str(site), *pins],
        check=True,
    )
    tests = WHEEL_DIR / "tests"  # the GPU-marked tests' timeout plugin, where the image lacks it
    tests.mkdir(exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(tests)]
        + [f"pytest-timeout=={metadata.version('pytest-timeout')}"],
        check=True,
    )
    return site


def wheel_path() -> Path:
    """The prepared wheel (raises when ``prepare`` has not been run)."""
    found = sorted(WHEEL_DIR.glob(f"deepspeed-{UPSTREAM_VERSION}-*.whl"))
    if not found:
        raise FileNotFoundError(f"no upstream wheel in {WHEEL_DIR}; run: python {__file__} prepare")
    return found[0]


def install(target: str = DEFAULT_TARGET) -> None:
    """Install the prepared wheel into ``target`` without touching any registry."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            target,
            str(wheel_path()),
        ],
        check=True,
    )


def worker_env(base: dict, target: str, extra_site: str | None) -> dict:
    """Environment of an upstream worker: its package first, never this repository."""
    paths = [target] + ([extra_site] if extra_site else [])
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("DS_BUILD_OPS", "0")
    return env


def check(target: str) -> str:
    """Import upstream from ``target`` in a clean subprocess and return '<version> <file>'."""
    env = worker_env(os.environ, target, os.environ.get("BENCH_EXTRA_SITE"))
    out = subprocess.run(
        [sys.executable, "-c", "import deepspeed; print(deepspeed.__version__, deepspeed.__file__)"],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["prepare", "site", "install", "check"])
    ap.add_argument("--target", default=DEFAULT_TARGET)
    a = ap.parse_args()
    if a.action == "prepare":
        print(prepare())
    elif a.action == "site":  # only the wheels of .whl_upstream/site/
        print(prepare_site())
    elif a.action == "install":
        install(a.target)
        print(check(a.target))
    else:
        print(check(a.target))
