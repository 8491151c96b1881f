"""The async I/O op (AsyncIOBuilder / aio_handle): bit-exact round trips, requests in flight, O_DIRECT alignment,
errors that name the file, both backends (libaio only where its headers were found at build time)."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest
import torch

from deepspeed.ops.op_builder.async_io import AsyncIOBuilder, libaio_available

BACKENDS = ("threads", "libaio")


@pytest.fixture(scope="session")
def aio_op() -> ModuleType:
    """The built async_io module (one ninja build per machine, cached in TORCH_EXTENSIONS_DIR)."""
    builder = AsyncIOBuilder()
    if not builder.is_compatible():
        pytest.skip(f"async_io cannot be built here: {builder.error_log}")
    return builder.load()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, aio_op: ModuleType) -> str:
    if request.param == "libaio" and not aio_op.libaio_compiled():
        pytest.skip("libaio headers were not found when the op was built (install libaio-dev)")
    return request.param


def _handle(aio_op: ModuleType, backend: str, **kw: object) -> object:
    h = aio_op.aio_handle(**kw, backend=backend)
    assert h.get_backend() == backend
    return h


def _random_bytes(nbytes: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def test_builder_names_and_report() -> None:
    b = AsyncIOBuilder()
    assert (b.NAME, b.BUILD_VAR, b.absolute_name()) == ("async_io", "DS_BUILD_AIO", "deepspeed.ops.aio.async_io_op")
    assert b.backend() == ("libaio" if libaio_available() else "threads")
    assert ("-DDS_AIO_HAVE_LIBAIO" in b.cxx_args()) == libaio_available()
    from deepspeed.ops.aio import AsyncIOBuilder as reexported

    assert reexported is AsyncIOBuilder


def test_ds_report_names_the_backend(capsys: pytest.CaptureFixture[str]) -> None:
    from deepspeed import env_report

    env_report.main()
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("async_io"))
    assert ("backend: libaio" if libaio_available() else "backend: threads") in row


# Sizes: aligned, one byte past a page, smaller than a page, several blocks with a ragged tail, empty.
@pytest.mark.parametrize("nbytes", [1 << 16, 4097, 1000, 3 * 65536 + 123, 0])
@pytest.mark.parametrize("threads", [1, 3])
def test_round_trip_bit_exact(aio_op: ModuleType, backend: str, tmp_path: Path, nbytes: int, threads: int) -> None:
    h = _handle(aio_op, backend, block_size=16384, queue_depth=4, intra_op_parallelism=threads)
    src = _random_bytes(nbytes)
    path = str(tmp_path / "t.swp")
    assert h.sync_pwrite(src, path) == 1
    assert os.path.getsize(path) == nbytes
    assert Path(path).read_bytes() == src.numpy().tobytes()
    out = torch.full((nbytes,), 7, dtype=torch.uint8)
    assert h.sync_pread(out, path) == 1
    assert torch.equal(out, src)


def test_float_tensor_and_offsets(aio_op: ModuleType, backend: str, tmp_path: Path) -> None:
    h = _handle(aio_op, backend, block_size=8192, queue_depth=2, intra_op_parallelism=2)
    a, b = torch.randn(5000), torch.randn(3001, dtype=torch.float64)
    path = str(tmp_path / "two.swp")
    h.sync_pwrite(a, path, 0)
    h.sync_pwrite(b, path, a.nbytes)  # second tensor right after the first: an unaligned file offset
    ra, rb = torch.empty_like(a), torch.empty_like(b)
    h.sync_pread(rb, path, a.nbytes)
    h.sync_pread(ra, path, 0)
    assert torch.equal(ra.view(torch.int32), a.view(torch.int32))
    assert torch.equal(rb.view(torch.int64), b.view(torch.int64))


def test_many_requests_in_flight(aio_op: ModuleType, backend: str, tmp_path: Path) -> None:
    h = _handle(aio_op, backend, block_size=4096, queue_depth=8, intra_op_parallelism=2)
    srcs = [_random_bytes(4096 * (i % 5) + 17 * i, seed=i) for i in range(40)]
    for i, s in enumerate(srcs):
        assert h.async_pwrite(s, str(tmp_path / f"{i}.swp")) == 0
    assert h.wait() == len(srcs)
    outs = [torch.empty_like(s) for s in srcs]
    for i, o in enumerate(outs):
        assert h.async_pread(o, str(tmp_path / f"{i}.swp")) == 0
    assert h.wait() == len(srcs)
    assert h.wait() == 0
    assert all(torch.equal(o, s) for o, s in zip(outs, srcs, strict=True))


def _threads_now() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_the_threads_backend_keeps_queue_depth_requests_in_flight(aio_op: ModuleType, tmp_path: Path) -> None:
    """Blocking calls keep one request in flight per thread, so the threads backend gives each intra-op worker
    min(queue_depth, 16) threads; libaio keeps its depth in the kernel with one thread per worker."""
    before = _threads_now()
    h = _handle(aio_op, "threads", block_size=4096, queue_depth=4, intra_op_parallelism=2)
    assert _threads_now() - before == 2 * 4
    deep = _handle(aio_op, "threads", block_size=4096, queue_depth=128, intra_op_parallelism=8)
    assert _threads_now() - before == 2 * 4 + 64  # 16 per worker at most, 64 in one handle
    del deep
    # A request is cut into one part per thread, each written and read back in place.
    src = _random_bytes(8 * 4096 * 3 + 1234, seed=5)
    h.sync_pwrite(src, str(tmp_path / "lanes.swp"))
    back = torch.empty_like(src)
    h.sync_pread(back, str(tmp_path / "lanes.swp"))
    assert torch.equal(back, src)
    if aio_op.libaio_compiled():
        before = _threads_now()
        kernel = _handle(aio_op, "libaio", block_size=4096, queue_depth=4, intra_op_parallelism=2)
        assert _threads_now() - before == 2
        del kernel


def test_unaligned_memory_goes_through_o_direct(aio_op: ModuleType, backend: str, tmp_path: Path) -> None:
    """A view starting 3 bytes into a tensor is not page aligned: the direct path stages it, values stay exact."""
    h = _handle(aio_op, backend, block_size=8192, queue_depth=4, intra_op_parallelism=1)
    base = _random_bytes(3 * 8192 + 3 + 100)
    view = base[3:]
    path = str(tmp_path / "u.swp")
    h.sync_pwrite(view, path)
    back = torch.zeros(view.numel() + 3, dtype=torch.uint8)[3:]
    h.sync_pread(back, path)
    assert torch.equal(back, view)


def test_locked_tensors_are_page_aligned(aio_op: ModuleType, backend: str, tmp_path: Path) -> None:
    h = _handle(aio_op, backend)
    t = h.new_cpu_locked_tensor(10_000, torch.empty(0, dtype=torch.float32))
    assert t.dtype == torch.float32 and t.numel() == 10_000
    assert t.data_ptr() % h.get_alignment() == 0 and h.is_pinned(t)
    assert not h.is_pinned(torch.empty(10))
    t.copy_(torch.randn(10_000))
    path = str(tmp_path / "l.swp")
    h.sync_pwrite(t, path)
    r = h.new_cpu_locked_tensor(10_000, t)
    h.sync_pread(r, path)
    assert torch.equal(r, t)
    assert h.free_cpu_locked_tensor(r)


def test_settings_and_upstream_call_forms(aio_op: ModuleType, tmp_path: Path) -> None:
    h = aio_op.aio_handle(65536, 16, True, True, 2)
    assert (h.get_block_size(), h.get_queue_depth(), h.get_single_submit(), h.get_overlap_events()) == (
        65536,
        16,
        True,
        True,
    )
    assert h.get_intra_op_parallelism() == 2
    src, path = torch.randn(777), str(tmp_path / "f.swp")
    assert h.write(src, path, True) == 1  # validate=True reads the file back
    out = torch.empty_like(src)
    assert h.pread(out, path, False, True) == 0 and h.wait() == 1
    assert torch.equal(out, src)
    assert aio_op.aio_write(src * 2, path, 4096, 4, False, True, True) == 1
    assert aio_op.aio_read(out, path, 4096, 4, False, True, False) == 1 and torch.equal(out, src * 2)
    dst = torch.empty_like(src)
    aio_op.deepspeed_memcpy(dst, src)
    assert torch.equal(dst, src)
    with pytest.raises(ValueError, match="block_size"):
        aio_op.aio_handle(1000)


def test_truncated_or_missing_file_is_an_error_not_zeros(aio_op: ModuleType, backend: str, tmp_path: Path) -> None:
    h = _handle(aio_op, backend, block_size=4096)
    path = tmp_path / "t.swp"
    h.sync_pwrite(torch.ones(5000), str(path))
    os.truncate(path, 4096)
    out = torch.empty(5000)
    with pytest.raises(RuntimeError, match=r"t\.swp.*holds 4096 bytes but 20000"):
        h.sync_pread(out, str(path))
    path.unlink()
    with pytest.raises(RuntimeError, match=r"cannot open .*t\.swp for reading"):
        h.sync_pread(out, str(path))


def test_tmpfs_falls_back_to_buffered_io(aio_op: ModuleType, backend: str) -> None:
    """tmpfs refuses O_DIRECT: the same calls work through the buffered descriptor."""
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    h = _handle(aio_op, backend, block_size=4096, intra_op_parallelism=2)
    path = f"/dev/shm/ds_aio_test_{os.getpid()}.swp"
    try:
        src = torch.randn(12345)
        h.sync_pwrite(src, path)
        out = torch.empty_like(src)
        h.sync_pread(out, path)
        assert torch.equal(out, src)
    finally:
        os.unlink(path)
