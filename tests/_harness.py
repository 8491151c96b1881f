"""Multi-process test harness: run a function (or a test method) in N ranks over gloo on CPU.

Two ways in, one mechanism underneath:

1. ``run_distributed(fn, world_size, *args, timeout=120.0)`` runs ``fn(*args)`` in ``world_size`` fresh processes
   and returns the list of per-rank return values (rank order). ``fn`` must be a module-level function of an
   importable module (a test module is fine; lambdas and nested functions are rejected); ``args`` and the return
   values must be picklable.

2. ``class TestX(DistributedTest): world_size = 2`` (an int, or a list to run each size), or
   ``@pytest.mark.world_size(n)`` on a test function/method (the marker wins over the class attribute). The test
   body then runs inside every rank; ``self.world_size`` is the int of the current run. Fixture values the test
   requests are built in the pytest process and pickled to the ranks (so ``tmp_path`` is shared by all ranks).
   The pytest hooks live in ``tests/conftest.py`` and call :func:`parametrize_world_size` / :func:`run_test_item`.

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, a free MASTER_PORT per call and
DS_ACCELERATOR=cpu, plus the caller's current environment and ``env=`` overrides; it runs with one intra-op thread,
calls ``deepspeed.comm.init_distributed(dist_backend='gloo')``, runs the function, meets the other ranks at a barrier
and destroys the group.

Failure handling: the first rank to raise fails the call with that rank's traceback; a rank that dies without
reporting fails it at once; if any rank has not reported after ``timeout`` seconds the call fails with the list of
silent ranks. In every case all rank processes are killed before the error is raised -- never a hang.

Cost: processes are forked from a ``forkserver`` that has already imported torch, torch._dynamo and deepspeed's
engines (``_PRELOAD``), so only the first call pays the ~5-7 s import; later calls cost roughly a fork plus a gloo
rendezvous. Set ``DS_TEST_START_METHOD=spawn`` to debug with fully fresh interpreters.
"""

from __future__ import annotations

import importlib
import importlib.util
import multiprocessing
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

DEFAULT_TIMEOUT = float(os.environ.get("DS_TEST_TIMEOUT", "120"))
_START_METHOD = os.environ.get("DS_TEST_START_METHOD", "forkserver")
# What nearly every rank imports, so that a fork inherits it instead of paying it: torch._dynamo (ZeRO-3's hooks
# are wrapped by torch.compiler.disable, which imports it: ~2.5 s per rank) and the engines (~0.5 s).
_PRELOAD = [
    "torch",
    "torch._dynamo",
    "deepspeed",
    "deepspeed.comm",
    "deepspeed.accelerator",
    "deepspeed.runtime.engine",
    "deepspeed.runtime.pipe.engine",
    "pytest",
    __name__,
]
WORLD_SIZE_FIXTURE = "_ds_world_size"


class DistributedTestError(AssertionError):
    """A rank raised, died or stalled; the message carries the rank's traceback or the silent ranks."""


class DistributedTimeout(DistributedTestError):
    """Some ranks did not report within the timeout."""


# ---------------------------------------------------------------------- parent side
def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    backend: str = "gloo",
    init_distributed: bool = True,
    env: dict[str, str] | None = None,
    fn_kwargs: dict[str, Any] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **fn_kwargs)`` in ``world_size`` ranks and return their results in rank order.

    Args:
        fn: module-level function of an importable module.
        world_size: number of ranks (>= 1).
        timeout: seconds before the still-silent ranks are declared stalled.
        backend: process-group backend passed to ``init_distributed``.
        init_distributed: set False to run ``fn`` without a process group (it may init one itself).
        env: extra environment variables for every rank.
        fn_kwargs: keyword arguments for ``fn``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    target = _function_ref(fn)
    try:
        payload = pickle.dumps((args, fn_kwargs or {}))
    except Exception as err:
        raise TypeError(f"arguments passed to ranks must be picklable: {err}") from err
    port = _free_port()
    base = {
        "fn": target,
        "payload": payload,
        "backend": backend,
        "init": init_distributed,
        "sys_path": list(sys.path),
        "world_size": world_size,
    }
    ctx = _context()
    procs, conns = [], []
    log_dir = tempfile.mkdtemp(prefix="ds-test-ranks-")
    try:
        for rank in range(world_size):
            spec = dict(
                base,
                rank=rank,
                env=_rank_env(rank, world_size, port, env),
                log_path=os.path.join(log_dir, f"rank{rank}.log"),
            )
            receiver, sender = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_main, args=(sender, spec), name=f"ds-test-rank{rank}")
            proc.start()
            sender.close()
            procs.append(proc)
            conns.append(receiver)
        return _collect(procs, conns, timeout)
    finally:
        _reap(procs)
        _replay_logs(log_dir, world_size)


def _replay_logs(log_dir: str, world_size: int) -> None:
    """Copy each rank's stdout/stderr into ours, where pytest captures it for the current test."""
    for rank in range(world_size):
        path = os.path.join(log_dir, f"rank{rank}.log")
        if os.path.exists(path) and os.path.getsize(path):
            with open(path, errors="replace") as fd:
                sys.stdout.write(f"----- rank {rank} output -----\n{fd.read()}\n")
    shutil.rmtree(log_dir, ignore_errors=True)


def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context(_START_METHOD)
    if _START_METHOD == "forkserver":
        # Takes effect when the server starts (first call); later calls reuse the warm server.
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def warm_up() -> None:
    """Start the forkserver now so its torch/deepspeed import overlaps with other work (no-op for spawn)."""
    if _START_METHOD == "forkserver":
        _context()
        from multiprocessing import forkserver

        forkserver.ensure_running()


def _function_ref(fn: Callable[..., Any]) -> dict[str, str | None]:
    qualname = getattr(fn, "__qualname__", "")
    if "<" in qualname or not getattr(fn, "__module__", None):
        raise TypeError(
            f"{fn!r} is not a module-level function; ranks import it by name, so define it at module "
            "scope of an importable module"
        )
    module = sys.modules.get(fn.__module__)
    return {"module": fn.__module__, "qualname": qualname, "file": getattr(module, "__file__", None)}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_env(rank: int, world_size: int, port: int, extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    env.update(extra or {})
    return env


def _collect(procs: list[Any], conns: list[Connection], timeout: float) -> list[Any]:
    """Wait for one message per rank; raise on the first error, death or the deadline."""
    deadline = time.monotonic() + timeout
    results: dict[int, Any] = {}
    pending = {rank for rank in range(len(procs))}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DistributedTimeout(
                f"ranks {sorted(pending)} did not finish within {timeout:.0f}s (stalled "
                f"collective or hang); ranks {sorted(results)} finished"
            )
        waitables = [conns[r] for r in pending] + [procs[r].sentinel for r in pending]
        ready = set(wait(waitables, timeout=remaining))
        for rank in sorted(pending):
            if conns[rank] in ready or (procs[rank].sentinel in ready and conns[rank].poll()):
                results[rank] = _receive(rank, conns[rank], procs[rank])
                pending.discard(rank)
            elif procs[rank].sentinel in ready:
                procs[rank].join(1)
                raise DistributedTestError(f"rank {rank} exited with code {procs[rank].exitcode} without reporting")
    return [results[r] for r in range(len(procs))]


def _receive(rank: int, conn: Connection, proc: Any) -> Any:
    try:
        status, body = conn.recv()
    except EOFError:
        proc.join(1)
        raise DistributedTestError(f"rank {rank} exited with code {proc.exitcode} without reporting") from None
    if status == "error":
        raise DistributedTestError(f"rank {rank} failed:\n{body}")
    return pickle.loads(body)


def _reap(procs: Sequence[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(5)


# ---------------------------------------------------------------------- rank side
def _resolve_module(module_name: str, file: str | None) -> Any:
    try:
        if module_name != "__main__":
            return importlib.import_module(module_name)
    except ImportError:
        if file is None:
            raise
    # Modules pytest imported in "importlib" mode (or __main__) are loaded from their file.
    spec = importlib.util.spec_from_file_location(module_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def _resolve(ref: dict[str, str | None]) -> Any:
    obj = _resolve_module(ref["module"], ref["file"])
    for part in ref["qualname"].split("."):
        obj = getattr(obj, part)
    return obj


def _redirect_output(path: str) -> None:
    # Ranks inherit the forkserver's stdout, not the current test's; a per-rank file lets the parent replay it
    # into the test's captured output.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _rank_main(conn: Connection, spec: dict[str, Any]) -> None:
    """Entry point of one rank process: set up, run, report exactly one message, exit."""
    _redirect_output(spec["log_path"])
    os.environ.clear()
    os.environ.update(spec["env"])
    sys.path[:] = spec["sys_path"]
    message: tuple[str, Any]
    try:
        import torch

        torch.set_num_threads(1)  # ranks share 2 cores; oversubscribed intra-op pools only slow things down
        message = ("ok", pickle.dumps(_run_rank(spec)))
    except BaseException:  # noqa: BLE001 - any failure, SystemExit included, must reach the parent
        message = ("error", traceback.format_exc())
    try:
        conn.send(message)
    finally:
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        # Skip interpreter teardown (atexit, torch cleanup): it is slow and can hang after a failed collective.
        os._exit(0)


def _run_rank(spec: dict[str, Any]) -> Any:
    fn = _resolve(spec["fn"])
    args, kwargs = pickle.loads(spec["payload"])
    if not spec["init"]:
        return fn(*args, **kwargs)
    from deepspeed import comm as dist

    dist.init_distributed(dist_backend=spec["backend"], verbose=False)
    result = fn(*args, **kwargs)
    # The store server lives in rank 0: nobody may leave before everyone is done with it.
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return result


# ---------------------------------------------------------------------- pytest integration
class DistributedTest:
    """Base class whose ``test_*`` methods run inside ``world_size`` ranks (an int or a list of ints).

    Class attributes: ``world_size`` (default 2), ``backend`` ("gloo"), ``init_distributed`` (True),
    ``exec_timeout`` (seconds, default 120). Inside a rank ``self.world_size`` is the current int.
    """

    world_size: int | list[int] = 2
    backend = "gloo"
    init_distributed = True
    exec_timeout = DEFAULT_TIMEOUT


def _marker_sizes(marker: Any) -> list[int]:
    values: list[Any] = list(marker.args) or [marker.kwargs.get("n", marker.kwargs.get("world_size"))]
    if len(values) == 1 and isinstance(values[0], (list, tuple)):
        values = list(values[0])
    return [int(v) for v in values]


def world_sizes_for(definition: Any, cls: type | None) -> list[int] | None:
    """World sizes a collected test runs at (``None``: not a distributed test)."""
    marker = definition.get_closest_marker("world_size")
    if marker is not None:
        return _marker_sizes(marker)
    if cls is not None and issubclass(cls, DistributedTest):
        sizes = cls.world_size
        return [sizes] if isinstance(sizes, int) else list(sizes)
    return None


def parametrize_world_size(metafunc: Any) -> None:
    """``pytest_generate_tests`` body: one test id per world size (``ws2``, ``ws4``...)."""
    sizes = world_sizes_for(metafunc.definition, metafunc.cls)
    if sizes is not None and WORLD_SIZE_FIXTURE in metafunc.fixturenames:
        metafunc.parametrize(WORLD_SIZE_FIXTURE, sizes, ids=[f"ws{n}" for n in sizes])


def run_test_item(pyfuncitem: Any) -> bool | None:
    """``pytest_pyfunc_call`` body: run a distributed test in its ranks; ``None`` lets pytest run others."""
    callspec = getattr(pyfuncitem, "callspec", None)
    world_size = callspec.params.get(WORLD_SIZE_FIXTURE) if callspec is not None else None
    if world_size is None:
        return None
    cls = pyfuncitem.cls
    kwargs = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    module = pyfuncitem.module
    ref = {
        "module": module.__name__,
        "file": getattr(module, "__file__", None),
        "cls": cls.__qualname__ if cls is not None else None,
        "name": pyfuncitem.originalname,
    }
    options = cls if cls is not None and issubclass(cls, DistributedTest) else DistributedTest
    run_distributed(
        _run_test_in_rank,
        world_size,
        ref,
        world_size,
        kwargs,
        timeout=options.exec_timeout,
        backend=options.backend,
        init_distributed=options.init_distributed,
    )
    return True


def _run_test_in_rank(ref: dict[str, str | None], world_size: int, kwargs: dict[str, Any]) -> None:
    owner = _resolve_module(ref["module"], ref["file"])
    if ref["cls"] is None:
        getattr(owner, ref["name"])(**kwargs)
        return
    for part in ref["cls"].split("."):
        owner = getattr(owner, part)
    instance = owner()
    instance.world_size = world_size
    getattr(instance, ref["name"])(**kwargs)
