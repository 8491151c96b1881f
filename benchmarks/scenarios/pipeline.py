"""Pipeline parallelism, S1's model: memory per stage against gradient accumulation, ours vs upstream.

    python benchmarks/scenarios/pipeline.py --out DIR                 # GPU: ours and upstream, GAS 1, 2, 4, 8, 16
    python benchmarks/scenarios/pipeline.py --out DIR --smoke         # CPU, seconds: a tiny model, ours only

Model and config: the GPT-NeoX model of ``examples/pipeline_gpt.py`` (24 layers, hidden 2048, 16 heads,
sequence 2048, rotary, untied head, vocabulary 50432) in 2 pipeline stages of 12 transformer layers each,
ZeRO-1 (buckets 5e8, overlap_comm, reduce_scatter, contiguous_gradients), fp16 with dynamic loss scaling
(window 1000, hysteresis 2, min scale 1, initial power 12), activation checkpointing every transformer layer,
clipping 1.0, torch AdamW (lr 2e-4, betas 0.9/0.95, eps 1e-8, weight decay 0.1), micro-batch 1, one replica.

How one configuration runs: both stages start together, each in its own process on the one GPU, under PyTorch's
fake process group (world size 2, rank = stage), so each process's allocator counters are exactly those of that
stage. Point-to-point messages go through a small shim (:class:`StoreWire`): the small metadata messages (shapes,
dtypes) travel for real over a TCP store, so each engine sets up its buffers as in a real run, and every ``recv``
waits for the matching ``send`` (the pipeline's real dependencies and bubbles); large payloads (activations and
gradients) are not copied: the receiver fills its buffer with zeros, so fp16 never overflows on garbage. Both
processes share the GPU, so step times are those of two stages time-sharing one device: compare ours with
upstream, not with a two-GPU run. Per stage and G: peak allocated / reserved over one measured step (after warm-up
step that creates the optimizer state), step time (median of the timed steps), tokens/s.

One process per (implementation, stage) runs every G in turn (``engine.set_train_batch_size`` between them, G
ascending), with 1 warm-up step, the measured step and 2 timed steps per G; ours and upstream run one after the
other (their step times are not mixed). ``--max-seconds`` (default 230) bounds the whole run: no G starts after
an implementation's share of it, and whatever finished is written.

Outputs in ``--out`` (five files): ``pipeline.jsonl`` (one record per stage, implementation and G; failures and
``not_run`` included), ``pipeline_summary.json`` and ``pipeline_summary.md`` (the targets below, per
implementation), ``pipeline_workers_log.txt`` (every worker's log tail); ``device_run.sh --scenario pipeline`` adds
``env.txt`` and ``stdout.txt``.

Targets (see docs/pipeline.md): last stage ``peak(G) - peak(1)`` within one reduce bucket (5e8 fp16 elements);
first stage ``peak(G) - peak(1) <= (min(P, G) - 1) x`` one micro-batch's activations (analytic: the checkpointed
layer inputs of the stage plus its output, ``(layers + 1) x seq x hidden x 2`` bytes; the measured
``peak(2) - peak(1)`` is recorded next to it); both at or below upstream at every G; tokens/s at G=16 at least
upstream's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
BENCH = HERE.parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))  # _harness (never the repository root: upstream workers must not see our package)
sys.path.insert(0, str(REPO / "examples"))  # the model definition (pipeline_gpt.py)

FULL = {"layers": 24, "hidden": 2048, "heads": 16, "seq": 2048, "vocab": 50432, "stages": 2}
SMOKE = {"layers": 4, "hidden": 32, "heads": 4, "seq": 16, "vocab": 61, "stages": 2}
BUCKET = int(5e8)
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SMALL_MESSAGE = 1024  # elements; messages up to this size travel for real (metadata); smoke lowers it


# ----------------------------------------------------------------------------------------------- the p2p shim
class StoreWire:
    """Replaces torch.distributed's point-to-point calls in a fake-group worker (see the module docstring)."""

    def __init__(self, rank: int, port: int, timeout_s: float, small: int = SMALL_MESSAGE) -> None:
        import datetime

        import torch.distributed as td

        self.td, self.rank = td, rank
        # The driver hosts the store, so it outlives whichever stage finishes first.
        self.store = td.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self.namespace = ""
        self.sent: dict[int, int] = {}
        self.received: dict[int, int] = {}
        self.small = small
        self.messages = 0
        self.small_messages = 0

    def install(self) -> None:
        """Patch send/recv/isend/irecv on torch.distributed (engines look them up at call time)."""
        td = self.td
        td.send, td.recv = self.send, self.recv
        td.isend, td.irecv = self.isend, self.irecv

    def begin(self, namespace: str) -> None:
        """Start a new message sequence (one per configuration the process runs)."""
        self.namespace = namespace
        self.sent, self.received = {}, {}
        self.messages = self.small_messages = 0

    def _key(self, src: int, dst: int, counter: dict[int, int], peer: int) -> str:
        n = counter.get(peer, 0)
        counter[peer] = n + 1
        return f"{self.namespace}/p2p/{src}->{dst}/{n}"

    def send(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **_: Any) -> None:
        key = self._key(self.rank, dst, self.sent, dst)
        self.messages += 1
        if tensor.numel() <= self.small:
            self.small_messages += 1
            self.store.set(key, tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            self.store.set(key, b"")

    def recv(self, tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, **_: Any) -> int:
        if src is None:
            raise RuntimeError("StoreWire: recv needs an explicit source rank")
        data = self.store.get(self._key(src, self.rank, self.received, src))
        if data:
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            tensor.copy_(raw.view(tensor.dtype).reshape(tensor.shape).to(tensor.device))
        else:
            tensor.zero_()
        return src

    def isend(self, tensor: torch.Tensor, dst: int, group: Any = None, tag: int = 0, **_: Any) -> Any:
        self.send(tensor, dst, group, tag)
        return _Done()

    def irecv(self, tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0, **_: Any) -> Any:
        self.recv(tensor, src, group, tag)
        return _Done()


class _Done:
    """A completed request."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


# ----------------------------------------------------------------------------------------------- worker
def _init_fake_group(impl: str, stage: int, world: int) -> None:
    os.environ.update(RANK=str(stage), LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE="1")
    if impl == "ours":
        from deepspeed import comm

        comm.init_distributed(dist_backend="fake", rank=stage, world_size=world)
        return
    import torch.distributed as td
    from torch.testing._internal.distributed.fake_pg import FakeStore

    td.init_process_group("fake", store=FakeStore(), rank=stage, world_size=world)
    import deepspeed

    deepspeed.init_distributed()


def ds_config(spec: dict) -> dict:
    """The same JSON config for ours and upstream (upstream keys only)."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": int(spec["gas"]),
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_optimization": {
            "stage": 1,
            "allgather_bucket_size": BUCKET,
            "reduce_bucket_size": BUCKET,
            "overlap_comm": True,
            "reduce_scatter": True,
            "contiguous_gradients": True,
        },
        **_precision(spec.get("dtype", "fp16")),
        "activation_checkpointing": {"partition_activations": bool(spec.get("partition_activations", False))},
    }


def _precision(dtype: str) -> dict:
    if dtype == "fp16":
        return {
            "fp16": {
                "enabled": True,
                "initial_scale_power": 12,
                "loss_scale_window": 1000,
                "hysteresis": 2,
                "min_loss_scale": 1,
            }
        }
    if dtype == "bf16":  # for a CPU check of upstream, which refuses fp16 on the CPU
        return {"bf16": {"enabled": True}}
    raise ValueError(f"--dtype {dtype!r}: valid fp16, bf16")


def _build_engine(spec: dict) -> Any:
    import deepspeed
    from _harness import make_optimizer
    from deepspeed.pipe import PipelineModule
    from pipeline_gpt import gpt_neox_layers, lm_loss

    m = spec["model"]
    layers = gpt_neox_layers(m["vocab"], m["hidden"], m["heads"], m["layers"], m["seq"])
    # checkpointable_layers: upstream cannot checkpoint the embedding chunk (its input needs no grad), so both
    # implementations checkpoint the transformer layers only, as GPT-NeoX does.
    module = PipelineModule(
        layers,
        num_stages=m["stages"],
        loss_fn=lm_loss,
        partition_method="type:TransformerLayerPipe",
        activation_checkpoint_interval=1,
        checkpointable_layers=["TransformerLayerPipe"],
    )
    config = ds_config(spec)
    deepspeed.checkpointing.configure(None, deepspeed_config=config)
    if torch.cuda.is_available():
        # On the device in fp16 before the client optimizer is built, as the other scenarios hand models over.
        module = module.to(torch.device("cuda", 0), dtype=_DTYPES[spec.get("dtype", "fp16")])
    engine, *_ = deepspeed.initialize(model=module, optimizer=make_optimizer(module.parameters()), config=config)
    return engine, module


def _batches(spec: dict, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    m = spec["model"]
    gen = torch.Generator().manual_seed(0)
    return [
        (
            torch.randint(0, m["vocab"], (1, m["seq"]), generator=gen),
            torch.randint(0, m["vocab"], (1, m["seq"]), generator=gen),
        )
        for _ in range(n)
    ]


def _set_gas(engine: Any, gas: int) -> None:
    """Change the micro-batches per step of a live engine (the global batch is micro-batch x G, one replica)."""
    engine.set_train_batch_size(gas * engine.train_micro_batch_size_per_gpu())
    if getattr(engine, "micro_batches", gas) != gas:
        raise RuntimeError(f"set_train_batch_size left micro_batches at {engine.micro_batches}, wanted {gas}")


def measure(engine: Any, spec: dict, gas: int) -> dict:
    """Warm up at ``gas``, then one step's peaks (fresh peak window) and the timed steps."""
    from _harness import mem, reset_peak, sync

    data = _batches(spec, gas)
    for _ in range(int(spec.get("warmup_steps", 1))):
        engine.train_batch(iter(data))
    sync()
    before = mem()
    reset_peak()
    engine.train_batch(iter(data))
    sync()
    measured = mem()
    times = []
    for _ in range(int(spec.get("timed_steps", 2))):
        sync()
        t0 = time.perf_counter()
        engine.train_batch(iter(data))
        sync()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    return {
        "peak_alloc_gib": measured["peak_alloc"],
        "peak_reserved_gib": measured["peak_reserved"],
        "alloc_before_gib": before["alloc"],
        "alloc_after_gib": measured["alloc"],
        "alloc_retries": measured["alloc_retries"],
        "step_s": step_s,
        "step_times_s": times,
        "tokens_per_s": gas * spec["model"]["seq"] / step_s,
        "skipped_steps_total": int(getattr(engine, "skipped_steps", 0) or 0),
    }


def run_stage(spec: dict, emit: Any) -> None:
    """One stage of one implementation, every G in turn in this process; ``emit(record)`` after each G.

    Both stages walk the same G list; before each G stage 0 decides (its deadline) whether to go on and stage 1
    follows that decision through the store, so neither waits for a peer that stopped.
    """
    import deepspeed

    stage, world = int(spec["stage"]), int(spec["model"]["stages"])
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    wire = StoreWire(
        stage, int(spec["port"]), float(spec.get("wire_timeout_s", 300)), int(spec.get("small_message", SMALL_MESSAGE))
    )
    wire.install()
    _init_fake_group(spec["impl"], stage, world)
    gases = [int(g) for g in spec["gases"]]
    wire.begin("init")
    t0 = time.perf_counter()
    engine, module = _build_engine(dict(spec, gas=gases[0]))
    init_s = time.perf_counter() - t0
    deadline = float(spec["deadline"])
    for gas in gases:
        go_key = f"{spec['impl']}/go/{gas}"
        if stage == 0:
            wire.store.set(go_key, b"1" if time.time() < deadline else b"0")
        if wire.store.get(go_key) != b"1":
            emit({"gas": gas, "status": "not_run", "reason": "--max-seconds budget"})
            continue
        wire.begin(f"{spec['impl']}/g{gas}")
        record: dict[str, Any] = {"gas": gas, "init_s": init_s}
        try:
            if gas != int(engine.gradient_accumulation_steps()):
                _set_gas(engine, gas)
            record.update(measure(engine, spec, gas), status="ok")
        except Exception as exc:  # recorded; the peer stalls on its store read and is killed
            record.update(
                status="error", error=f"{type(exc).__name__}: {exc}"[:2000], traceback=traceback.format_exc()[-4000:]
            )
            emit(record)
            raise
        record.update(
            layers=[int(x) for x in module.parts],
            stage_layers=_stage_layers(module),
            p2p_messages=wire.messages,
            p2p_small_messages=wire.small_messages,
            deepspeed_file=deepspeed.__file__,
            deepspeed_version=deepspeed.__version__,
        )
        emit(record)


def _stage_layers(module: Any) -> int:
    return sum(type(f).__name__ == "TransformerLayerPipe" for f in module.forward_funcs)


def worker(spec_json: str, result: str) -> None:
    """Run :func:`run_stage`, appending one JSON line per G to ``result``."""
    spec = json.loads(spec_json)
    base: dict[str, Any] = {
        "scenario": "pipeline",
        **{k: v for k, v in spec.items() if k not in ("port", "gases", "deadline")},
    }
    base["device_name"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    base["torch"] = torch.__version__
    with open(result, "a") as f:

        def emit(rec: dict) -> None:
            f.write(json.dumps({**base, **rec}, default=str) + "\n")
            f.flush()

        try:
            run_stage(spec, emit)
        except Exception as exc:  # noqa: BLE001 - set-up failures are recorded too
            emit(
                {
                    "gas": None,
                    "status": "error",
                    "error": f"{type(exc).__name__}: {exc}"[:2000],
                    "traceback": traceback.format_exc()[-4000:],
                }
            )
    sys.stdout.flush()
    os._exit(0)  # no teardown of the fake group and the store


# ----------------------------------------------------------------------------------------------- driver
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(impl: str, args: argparse.Namespace) -> dict:
    env = dict(
        os.environ, PYTHONUNBUFFERED="1", DS_BUILD_OPS="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port())
    )
    root = args.upstream_target if impl == "upstream" else str(REPO)
    env["PYTHONPATH"] = os.pathsep.join([root] + ([args.extra_site] if args.extra_site else []))
    if not torch.cuda.is_available():
        env["DS_ACCELERATOR"] = "cpu"
        env["OMP_NUM_THREADS"] = "1"
    return env


def run_impl(
    impl: str, gases: list[int], args: argparse.Namespace, model: dict, tmp: Path, port: int, deadline: float
) -> list[dict]:
    """Both stages of ``impl`` (one process each, all G in turn), started together; returns their records."""
    env = _env(impl, args)
    procs = []
    for stage in range(model["stages"]):
        spec = {
            "impl": impl,
            "gases": gases,
            "stage": stage,
            "model": model,
            "port": port,
            "deadline": deadline,
            "warmup_steps": args.warmup_steps,
            "timed_steps": args.timed_steps,
            "partition_activations": args.partition_activations,
            "wire_timeout_s": args.stall_s,
            "small_message": 300 if args.smoke else SMALL_MESSAGE,
            "dtype": args.dtype,
        }
        result, log_path = tmp / f"{impl}_s{stage}.jsonl", tmp / f"{impl}_s{stage}.log"
        log = open(log_path, "w")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec), "--result", str(result)]
        procs.append(
            (subprocess.Popen(cmd, env=env, cwd="/tmp", stdout=log, stderr=subprocess.STDOUT), result, log, stage)
        )
    # Stage processes stop by themselves at the budget; the grace covers the G that was running then.
    hard_stop = deadline + args.grace_s
    for proc, _, log, _ in procs:
        try:
            proc.wait(timeout=max(1.0, hard_stop - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    records = []
    for proc, result, log, stage in procs:
        found = [json.loads(line) for line in result.read_text().splitlines()] if result.exists() else []
        records += found
        if not any(r.get("status") == "ok" for r in found) and not any(r.get("status") == "error" for r in found):
            records.append(
                {
                    "scenario": "pipeline",
                    "impl": impl,
                    "stage": stage,
                    "gas": None,
                    "status": "error",
                    "error": f"no result (rc {proc.returncode})",
                    "log_tail": Path(log.name).read_text()[-3000:],
                }
            )
    return records


def activation_bytes(model: dict, stage_layers: int) -> int:
    """One micro-batch's held activations on a stage: each checkpointed layer's input plus the stage output (fp16)."""
    return (stage_layers + 1) * model["seq"] * model["hidden"] * 2


def summarize(records: list[dict], model: dict) -> dict:
    """Growth of each stage's peak with G against the targets, per implementation, and against upstream."""
    P = model["stages"]
    ok = {(r["impl"], r["gas"], r["stage"]): r for r in records if r.get("status") == "ok"}
    impls = sorted({r["impl"] for r in records})
    gases = sorted({r["gas"] for r in records})
    out: dict[str, Any] = {"model": model, "bucket_bytes_fp16": BUCKET * 2, "per_impl": {}}
    for impl in impls:
        rows = []
        for gas in gases:
            row: dict[str, Any] = {"gas": gas}
            for stage in range(P):
                rec, base = ok.get((impl, gas, stage)), ok.get((impl, 1, stage))
                if rec is None:
                    row[f"s{stage}"] = None
                    continue
                growth = (rec["peak_alloc_gib"] - base["peak_alloc_gib"]) * 2**30 if base else None
                row[f"s{stage}"] = {
                    "peak_alloc_gib": rec["peak_alloc_gib"],
                    "peak_reserved_gib": rec["peak_reserved_gib"],
                    "growth_bytes": growth,
                    "step_s": rec["step_s"],
                    "tokens_per_s": rec["tokens_per_s"],
                }
                act = activation_bytes(model, rec["stage_layers"])
                allowed = (min(P - stage, gas) - 1) * act if stage < P - 1 else BUCKET * 2
                row[f"s{stage}"].update(
                    allowed_growth_bytes=allowed, meets_target=None if growth is None else growth <= allowed
                )
            rows.append(row)
        out["per_impl"][impl] = rows
    out["vs_upstream"] = _versus(ok, gases, P) if "upstream" in impls and "ours" in impls else None
    return out


def _versus(ok: dict, gases: list[int], P: int) -> list[dict]:
    rows = []
    for gas in gases:
        row: dict[str, Any] = {"gas": gas}
        for stage in range(P):
            a, b = ok.get(("ours", gas, stage)), ok.get(("upstream", gas, stage))
            if a and b:
                row[f"s{stage}_peak_alloc_ours_minus_upstream_gib"] = a["peak_alloc_gib"] - b["peak_alloc_gib"]
                row[f"s{stage}_at_or_below_upstream"] = a["peak_alloc_gib"] <= b["peak_alloc_gib"]
        a_t = [ok[("ours", gas, s)]["tokens_per_s"] for s in range(P) if ("ours", gas, s) in ok]
        b_t = [ok[("upstream", gas, s)]["tokens_per_s"] for s in range(P) if ("upstream", gas, s) in ok]
        if len(a_t) == P and len(b_t) == P:
            # A step ends when its slowest stage does.
            row["tokens_per_s_ours"], row["tokens_per_s_upstream"] = min(a_t), min(b_t)
            row["tokens_per_s_ratio"] = min(a_t) / min(b_t)
        rows.append(row)
    return rows


def to_markdown(summary: dict, records: list[dict]) -> str:
    """The per-stage table and the comparison, as Markdown."""
    lines = [
        f"# Pipeline benchmark (P={summary['model']['stages']}, model {summary['model']})",
        "",
        "| impl | G | stage | peak alloc GiB | peak reserved GiB | growth vs G=1 MiB | allowed MiB | target | "
        "step s | tokens/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for impl, rows in summary["per_impl"].items():
        for row in rows:
            for key in sorted(k for k in row if k.startswith("s")):
                c = row[key]
                if c is None:
                    lines.append(f"| {impl} | {row['gas']} | {key[1:]} | failed | | | | | | |")
                    continue
                growth = "" if c["growth_bytes"] is None else f"{c['growth_bytes'] / 2**20:.1f}"
                lines.append(
                    f"| {impl} | {row['gas']} | {key[1:]} | {c['peak_alloc_gib']:.3f} | "
                    f"{c['peak_reserved_gib']:.3f} | {growth} | {c['allowed_growth_bytes'] / 2**20:.3f} | "
                    f"{c['meets_target']} | {c['step_s']:.3f} | {c['tokens_per_s']:.0f} |"
                )
    if summary.get("vs_upstream"):
        lines += ["", "## ours vs upstream", "", "```", json.dumps(summary["vs_upstream"], indent=1), "```"]
    failed = [r for r in records if r.get("status") != "ok"]
    if failed:
        lines += ["", "## failures", ""] + [
            f"- {r['impl']} G={r['gas']} stage {r['stage']}: {r.get('error')}" for r in failed
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=False)
    ap.add_argument("--smoke", action="store_true", help="tiny model on CPU, ours only, GAS 1,2,4")
    ap.add_argument("--impls", default=None, help="comma list of ours,upstream (default both; smoke: ours)")
    ap.add_argument("--gas", default=None, help="comma list (default 1,2,4,8,16; smoke 1,2,4)")
    ap.add_argument("--dtype", default="fp16", help="fp16 (the report's) or bf16 (upstream on a CPU)")
    ap.add_argument("--warmup-steps", type=int, default=1)
    ap.add_argument("--timed-steps", type=int, default=2)
    ap.add_argument(
        "--partition-activations",
        action="store_true",
        help="partition_activations (the report's setting; with model parallel size 1 it splits nothing)",
    )
    ap.add_argument("--upstream-target", default="/tmp/upstream_ds")
    ap.add_argument("--extra-site", default=None)
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=230.0,
        help="wall budget of the whole run: no G is started after it; what finished is written",
    )
    ap.add_argument("--grace-s", type=float, default=60.0, help="time a G already running may take past the budget")
    ap.add_argument("--stall-s", type=float, default=240.0, help="a store read waiting longer fails the stage")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.result)
        return 0
    if not args.out:
        ap.error("--out is required")
    model = SMOKE if args.smoke else FULL
    impls = (args.impls or ("ours" if args.smoke else "ours,upstream")).split(",")
    gases = [int(g) for g in (args.gas or ("1,2,4" if args.smoke else "1,2,4,8,16")).split(",")]
    if args.smoke:
        args.warmup_steps, args.timed_steps = 1, 1
    return _drive(args, model, impls, gases)


def _drive(args: argparse.Namespace, model: dict, impls: list[str], gases: list[int]) -> int:
    """Run each implementation in turn (both stages at once), sharing the wall budget; write the outputs."""
    import datetime
    import tempfile

    import torch.distributed as td

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    port = _free_port()
    store = td.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=args.stall_s)
    )
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="pipeline_bench_") as tmp_name:
        tmp = Path(tmp_name)
        for n, impl in enumerate(impls):
            # Each implementation gets an equal share of what is left of the budget.
            deadline = time.time() + (start + args.max_seconds - time.time()) / (len(impls) - n)
            t0 = time.time()
            got = run_impl(impl, gases, args, model, tmp, port, deadline)
            records += got
            print(
                f"pipeline {impl}: {[(r.get('stage'), r.get('gas'), r.get('status')) for r in got]} "
                f"({time.time() - t0:.0f} s)",
                flush=True,
            )
            with open(out / "pipeline.jsonl", "w") as f:  # rewritten after each implementation
                f.writelines(json.dumps(r) + "\n" for r in records)
        _write_logs(tmp, out / "pipeline_workers_log.txt")
    del store
    summary = summarize([r for r in records if r.get("gas") is not None], model)
    summary["wall_s"] = round(time.time() - start, 1)
    (out / "pipeline_summary.json").write_text(json.dumps(summary, indent=1))
    (out / "pipeline_summary.md").write_text(to_markdown(summary, records))
    print(to_markdown(summary, records))
    return 0 if all(r.get("status") == "ok" for r in records) else 1


def _write_logs(tmp: Path, dest: Path) -> None:
    """Every worker's log tail in one file (the device returns few files)."""
    with open(dest, "w") as f:
        for log in sorted(tmp.glob("*.log")):
            f.write(f"===== {log.name}\n{log.read_text()[-20000:]}\n")


if __name__ == "__main__":
    sys.exit(main())
