"""Shared pieces of the benchmark workers: the spec, process-group set-up, memory probes, engine adapters.

A worker is one scenario run in its own process (fresh CUDA context, so peaks of different configurations never
mix). ``run_all.py`` starts it as ``python benchmarks/scenarios/<s>.py --spec '<json>' --result <file>``; the
worker writes exactly one JSON object to ``--result``: the measurements, or ``{"status": "error", ...}``.

Implementations (``spec["impl"]``):
* ``ours``         deepspeed-lean from this repository, lean switches on (the default);
* ``ours_leanoff`` deepspeed-lean with ``lean_inplace_flatten`` / ``lean_eager_grad_release`` /
                   ``lean_stream_ordered_release`` / ``lean_grads_in_param_shards`` false (upstream behaviour of
                   each mechanism, for A/B);
* ``upstream``     upstream DeepSpeed, imported from a separate target directory (see baselines/upstream.py);
* ``fsdp2``        PyTorch ``fully_shard`` per block (see baselines/fsdp2.py).
The DeepSpeed API is the same for ``ours`` and ``upstream``: which package is imported is decided by PYTHONPATH,
set by ``run_all.py``; every record carries ``deepspeed.__file__`` so this can be checked.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

GiB = float(1 << 30)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
MEMORY_TIMELINE_DIR = os.path.join(os.path.dirname(BENCH_DIR), "deepspeed", "tools", "profiling", "memory_timeline")


def load_memory_timeline(name: str = "bench_memory_timeline") -> Any:
    """This repository's ``memory_timeline`` package loaded by path under ``name`` (never through ``import
    deepspeed``, which may be upstream's in the worker): standard library only, relative imports resolved through
    the ``sys.modules`` entry registered here."""
    if name in sys.modules:
        return sys.modules[name]
    init = os.path.join(MEMORY_TIMELINE_DIR, "__init__.py")
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[MEMORY_TIMELINE_DIR])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {init}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


# ----------------------------------------------------------------------------------------------- device / memory
def device() -> torch.device:
    """The GPU when there is one, else the CPU (smoke tests)."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def sync() -> None:
    """Wait for queued device work (no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def mem() -> dict[str, float]:
    """Caching-allocator counters of this process in GiB (zeros on CPU)."""
    if not torch.cuda.is_available():
        return {"alloc": 0.0, "reserved": 0.0, "peak_alloc": 0.0, "peak_reserved": 0.0, "alloc_retries": 0}
    s = torch.cuda.memory_stats()
    return {
        "alloc": torch.cuda.memory_allocated() / GiB,
        "reserved": torch.cuda.memory_reserved() / GiB,
        "peak_alloc": torch.cuda.max_memory_allocated() / GiB,
        "peak_reserved": torch.cuda.max_memory_reserved() / GiB,
        "alloc_retries": int(s.get("num_alloc_retries", 0)),
    }


def reset_peak() -> None:
    """Start a new peak window."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


class RssSampler:
    """Samples this process's resident set size every ``period`` seconds in a thread; ``peak`` in bytes."""

    def __init__(self, period: float = 0.002) -> None:
        import psutil

        self._proc = psutil.Process()
        self._period = period
        self._stop = threading.Event()
        self.start_rss = self._proc.memory_info().rss
        self.peak = self.start_rss
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self._period)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.end_rss = self._proc.memory_info().rss
        self.peak = max(self.peak, self.end_rss)


def one_rank_env(port: int | None = None) -> None:
    """The environment both packages read for a one-rank process group, where a launcher has not set it."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(port or 29500 + os.getpid() % 1000))


def single_worker_env(impl: str, upstream_target: str, extra_site: str | None, port: int, cpu_only: bool) -> dict:
    """Environment of a one-rank worker process: upstream's package or this repository first on the path,
    its own rendezvous port, no op built ahead of time; ``cpu_only`` pins the CPU accelerator (smoke runs)."""
    repo = os.path.dirname(BENCH_DIR)
    env = dict(os.environ)
    root = upstream_target if impl == "upstream" else repo
    env["PYTHONPATH"] = os.pathsep.join([root] + ([extra_site] if extra_site else []))
    env.update(
        PYTHONUNBUFFERED="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        DS_BUILD_OPS="0",
    )
    if cpu_only:
        env["DS_ACCELERATOR"] = "cpu"
    return env


# ----------------------------------------------------------------------------------------------- process group
def init_process_group(impl: str, world_size: int) -> None:
    """World size 1: a real one-rank group (nccl/gloo). Larger: PyTorch's fake group (rank 0 of ``world_size``)."""
    import torch.distributed as td

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    if world_size == 1:
        if impl == "fsdp2":
            td.init_process_group("nccl" if torch.cuda.is_available() else "gloo", rank=0, world_size=1)
        return  # deepspeed.initialize creates it (ours and upstream alike)
    if impl.startswith("ours"):
        from deepspeed import comm

        comm.init_distributed(dist_backend="fake", rank=0, world_size=world_size)
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    td.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def warm_up_deepspeed(impl: str) -> None:
    """Import the engine and create its process group before any timed window (imports are not init cost)."""
    # torch.optim's first construction imports torch._dynamo (seconds): keep that out of timed windows too.
    make_optimizer([torch.nn.Parameter(torch.zeros(1, device=device()))])
    if impl == "fsdp2":
        return
    import deepspeed
    import deepspeed.runtime.engine

    deepspeed.init_distributed()


# ----------------------------------------------------------------------------------------------- configs
def ds_config(spec: dict) -> dict:
    """DeepSpeed JSON config of a spec (identical for ours and upstream, plus the lean switches for ours)."""
    gas = int(spec.get("gas", 1))
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": int(spec.get("micro_batch", 1)),
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": int(spec["stage"]),
            "allgather_bucket_size": int(spec.get("bucket", 5e8)),
            "reduce_bucket_size": int(spec.get("bucket", 5e8)),
            "overlap_comm": True,
            "reduce_scatter": True,
            "contiguous_gradients": True,
        },
    }
    if spec.get("dtype", "bf16") == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif spec["dtype"] == "fp16":
        # S1's loss-scaler settings, with a lower initial power so random-weight steps are not skipped.
        cfg["fp16"] = {
            "enabled": True,
            "initial_scale_power": 12,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    if spec["impl"] == "ours_leanoff":
        cfg["zero_optimization"].update(
            lean_inplace_flatten=False,
            lean_eager_grad_release=False,
            lean_stream_ordered_release=False,
            lean_grads_in_param_shards=False,
        )
    return cfg


def hf_auto_config(spec: dict, hidden: int) -> dict:
    """Scenario S3's DeepSpeed config: what HF Trainer's ``"auto"`` values resolve to for hidden size ``hidden``.

    ZeRO-3 (``spec["stage"]`` 3, the default): ``stage3_prefetch_bucket_size`` 0.9·h², ``stage3_param_persistence_
    threshold`` 10·h, ``reduce_bucket_size`` h², max live parameters and reuse distance 1e9, overlap_comm,
    contiguous_gradients, 16-bit weights gathered on save; bf16, clipping 1.0, micro-batch 1. ZeRO-2 (the S3
    comparison row): HF's ZeRO-2 template (``allgather_bucket_size`` 2e8, ``reduce_bucket_size`` h², overlap_comm,
    reduce_scatter, contiguous_gradients). ``spec["offload"]`` puts the optimizer on the CPU (pinned) and allows the
    client torch optimizer there (``zero_force_ds_cpu_optimizer`` false, else upstream refuses it);
    ``spec["offload_param"]`` also offloads the parameter shards (stage 3). ``ours_leanoff`` gets the lean
    switches off, as in :func:`ds_config`; ``spec["zero"]`` (ours only, with a ``tag``) overrides single keys.
    """
    h = int(hidden)
    stage = int(spec.get("stage") or 3)
    zero: dict[str, Any] = {
        "stage": stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": h * h,
    }
    if stage == 3:
        zero.update(
            stage3_prefetch_bucket_size=int(0.9 * h * h),
            stage3_param_persistence_threshold=10 * h,
            stage3_max_live_parameters=int(1e9),
            stage3_max_reuse_distance=int(1e9),
            stage3_gather_16bit_weights_on_model_save=True,
        )
    else:
        zero.update(allgather_bucket_size=int(2e8), reduce_scatter=True)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": int(spec.get("micro_batch", 1)),
        "gradient_accumulation_steps": int(spec.get("gas", 1)),
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
    }
    if int(spec.get("world_size", 1)) > 1:
        # Fake process group: collectives leave outputs uninitialised, so an overflow check would skip every step
        # and the optimizer state would never exist (ours checks bf16 by default; upstream's default is off).
        cfg["bf16"]["check_grad_overflow"] = False
    if spec.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        cfg["zero_force_ds_cpu_optimizer"] = False
    if spec.get("offload_param") and stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if spec["impl"] == "ours_leanoff":
        zero.update(
            lean_inplace_flatten=False,
            lean_eager_grad_release=False,
            lean_stream_ordered_release=False,
            lean_grads_in_param_shards=False,
        )
    if spec.get("zero"):  # A/B of single switches of this package: a ``tag`` names the variant's scenario
        if not spec["impl"].startswith("ours"):
            raise ValueError(f"spec 'zero' overrides are for this package's runs, not {spec['impl']!r}")
        if not spec.get("tag"):
            raise ValueError("a spec with 'zero' overrides needs a 'tag' naming the variant")
        zero.update(spec["zero"])
    return cfg


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    """S1's Adam settings as torch AdamW (fused on CUDA); the same object type for every implementation."""
    return torch.optim.AdamW(
        params, lr=2e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=torch.cuda.is_available()
    )


# ----------------------------------------------------------------------------------------------- engines
class Trainer:
    """The three calls the scenarios need, for every implementation: ``loss(batch)``, ``backward``, ``step``."""

    name = "base"
    engine: Any = None

    def loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def info(self) -> dict:
        """Implementation facts for the record (optimizer class, skipped steps, live gradient buffers, ...)."""
        return {}


class TorchLoopTrainer(Trainer):
    """The plain PyTorch loop around an already wrapped (or bare) module: ``gas`` micro-steps accumulate into
    ``.grad``, then ``clip_grad_norm_(1.0)``, the AdamW step of :func:`make_optimizer` and ``zero_grad``."""

    def __init__(self, model: torch.nn.Module, spec: dict) -> None:
        self.model = model
        self.gas = int(spec.get("gas", 1))
        self.optimizer = make_optimizer(model.parameters())
        self._micro = 0
        self.steps = 0

    def loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(ids, labels)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.gas).backward()

    def step(self) -> None:
        self._micro += 1
        if self._micro % self.gas:
            return
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1


class DeepSpeedTrainer(Trainer):
    """``deepspeed.initialize`` of whichever ``deepspeed`` package is on the path (ours or upstream)."""

    def __init__(self, model: torch.nn.Module, spec: dict, config: dict | None = None) -> None:
        """``config`` defaults to :func:`ds_config` of ``spec``."""
        import deepspeed

        self.name = spec["impl"]
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model,
            optimizer=make_optimizer(model.parameters()),
            config=config if config is not None else ds_config(spec),
        )

    def loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.engine(ids, labels)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def info(self) -> dict:
        import deepspeed

        out = {
            "optimizer_class": type(self.engine.optimizer).__name__,
            "skipped_steps": int(getattr(self.engine, "skipped_steps", 0) or 0),
            "deepspeed_file": deepspeed.__file__,
            "deepspeed_version": deepspeed.__version__,
        }
        live = getattr(self.engine.optimizer, "live_grad_buffers", None)
        if callable(live):
            out["live_grad_buffers"] = live()
        return out


# ----------------------------------------------------------------------------------------------- worker main
def default_checkpoint_reentrant(spec: dict) -> bool:
    """Activation-checkpoint form when a spec does not say (``spec["checkpoint_reentrant"]`` wins): reentrant for
    upstream at ZeRO-3 (S3, and the stage-3 throughput row), whose ZeRO-3 fails under torch's non-reentrant
    checkpoint on the H200 image (HF Transformers' ``gradient_checkpointing_enable`` defaults to reentrant too);
    non-reentrant otherwise."""
    if "checkpoint_reentrant" in spec:
        return bool(spec["checkpoint_reentrant"])
    return spec.get("impl") == "upstream" and spec.get("stage", 3) == 3


def worker_main(scenario: str, body: Callable[[dict], dict]) -> None:
    """Parse ``--spec``/``--result``, run ``body(spec)``, and write its record (or the error) to the result file."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    ap.add_argument("--result", required=True)
    args = ap.parse_args()
    spec = json.loads(args.spec)
    record: dict[str, Any] = {"scenario": scenario, **spec}
    with contextlib.suppress(Exception):  # informational only
        import psutil

        record["startup_s"] = round(time.time() - psutil.Process().create_time(), 2)  # process start to here
    t0 = time.perf_counter()
    try:
        init_process_group(spec["impl"], int(spec.get("world_size", 1)))
        warm_up_deepspeed(spec["impl"])
        record.update(body(spec))
        record["status"] = "skipped" if "skip_reason" in record else "ok"
    except Exception as exc:  # noqa: BLE001 -- the record says what failed; run_all keeps going
        record.update(
            status="error", error=f"{type(exc).__name__}: {exc}"[:2000], traceback=traceback.format_exc()[-4000:]
        )
        if torch.cuda.is_available():
            record["mem_at_error"] = mem()
    record["worker_wall_s"] = round(time.perf_counter() - t0, 2)
    record["torch_threads"] = torch.get_num_threads()
    record["device_name"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    record["torch"] = torch.__version__
    with open(args.result, "w") as f:
        json.dump(record, f)
    # Skip interpreter teardown of the process group (fake groups and NCCL can be slow to destroy).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(3 if record["status"] == "error" else 0)
