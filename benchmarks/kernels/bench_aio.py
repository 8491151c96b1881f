"""The async I/O op against plain file I/O: write and read throughput of one file system, per handle setting.

    PYTHONPATH=. python benchmarks/kernels/bench_aio.py --dir /tmp/aio_bench --mib 1024 --queue-depths 1,8,32

NVMe offload moves every step chunk's master and optimizer state through ``deepspeed.ops.aio`` handles, so a
step with states on disk cannot be faster than those bytes over the throughput measured here. Each record is one
(backend, block size, queue depth, intra-op parallelism) setting, with the median GiB/s of ``--reps`` timed
transfers of ``--mib`` MiB from and into a page-aligned, page-locked buffer: ``sync_pwrite`` (past the page cache
when it returns: the handle opens files with ``O_DIRECT`` where the file system accepts it) and ``sync_pread``
into a second buffer, checked byte for byte against what was written. The reference rows are the same transfer
through Python's buffered file objects (``write`` then ``os.fsync``; ``readinto`` after
``posix_fadvise(DONTNEED)``, which asks the kernel to drop the file's cached pages so that the read comes from the
device where it can).

Files are removed at the end. Runs on any machine (no accelerator needed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GiB = float(1 << 30)


def _median_gibs(run, nbytes: int, reps: int) -> float:
    seconds = []
    for _ in range(reps):
        start = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - start)
    return nbytes / GiB / statistics.median(seconds)


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def python_reference(path: Path, data: torch.Tensor, reps: int) -> dict:
    """Buffered Python file I/O of the same bytes: write + fsync, then read after dropping the cached pages."""
    view = memoryview(data.numpy()).cast("B")
    back = torch.empty_like(data)
    back_view = memoryview(back.numpy()).cast("B")

    def write() -> None:
        with open(path, "wb") as f:
            f.write(view)
            f.flush()
            os.fsync(f.fileno())

    def read() -> None:
        _drop_cache(path)
        with open(path, "rb", buffering=0) as f:
            f.readinto(back_view)

    write_gibs = _median_gibs(write, data.numel(), reps)
    read_gibs = _median_gibs(read, data.numel(), reps)
    return {"backend": "python", "write_gibs": write_gibs, "read_gibs": read_gibs, "exact": torch.equal(back, data)}


def handle_row(module, path: Path, data: torch.Tensor, reps: int, backend: str, block: int, depth: int, threads: int):
    """One handle setting's write and read throughput, and whether the read-back equals what was written."""
    handle = module.aio_handle(
        block_size=block,
        queue_depth=depth,
        single_submit=False,
        overlap_events=True,
        intra_op_parallelism=threads,
        backend=backend,
    )
    src = handle.new_cpu_locked_tensor(data.numel(), data)
    src.copy_(data)
    back = handle.new_cpu_locked_tensor(data.numel(), data)
    back.zero_()
    write_gibs = _median_gibs(lambda: handle.sync_pwrite(src, str(path)), data.numel(), reps)

    def read() -> None:
        _drop_cache(path)
        handle.sync_pread(back, str(path))

    read_gibs = _median_gibs(read, data.numel(), reps)
    return {
        "backend": handle.get_backend(),
        "block_size": block,
        "queue_depth": depth,
        "intra_op_parallelism": threads,
        "write_gibs": write_gibs,
        "read_gibs": read_gibs,
        "exact": torch.equal(back, data),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("/tmp/aio_bench"))
    ap.add_argument("--mib", type=int, default=1024, help="bytes per transfer, MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backends", default="threads,libaio", help="those not compiled in are skipped")
    ap.add_argument("--block-sizes", default="1048576")
    ap.add_argument("--queue-depths", default="1,8,32")
    ap.add_argument("--threads", default="1,4", help="intra_op_parallelism values")
    ap.add_argument("--out", type=Path, default=None, help="JSON lines (appended)")
    args = ap.parse_args()

    from deepspeed.ops.aio import load

    module = load()
    args.dir.mkdir(parents=True, exist_ok=True)
    path = args.dir / "bench_aio.bin"
    data = torch.randint(0, 256, (args.mib << 20,), dtype=torch.uint8)
    rows = [python_reference(path, data, args.reps)]
    backends = [b for b in args.backends.split(",") if b != "libaio" or module.libaio_compiled()]
    for backend in backends:
        for block in (int(b) for b in args.block_sizes.split(",")):
            for depth in (int(q) for q in args.queue_depths.split(",")):
                for threads in (int(t) for t in args.threads.split(",")):
                    rows.append(handle_row(module, path, data, args.reps, backend, block, depth, threads))
    path.unlink(missing_ok=True)
    meta = {"mib": args.mib, "dir": str(args.dir), "reps": args.reps}
    print(f"{'backend':8} {'block':>8} {'depth':>5} {'thr':>3} {'write GiB/s':>11} {'read GiB/s':>10} exact")
    for row in rows:
        print(
            f"{row['backend']:8} {row.get('block_size', ''):>8} {row.get('queue_depth', ''):>5} "
            f"{row.get('intra_op_parallelism', ''):>3} {row['write_gibs']:11.2f} {row['read_gibs']:10.2f} "
            f"{row['exact']}"
        )
    if args.out is not None:
        with args.out.open("a") as sink:
            for row in rows:
                print(json.dumps({**meta, **row}), file=sink)


if __name__ == "__main__":
    main()
