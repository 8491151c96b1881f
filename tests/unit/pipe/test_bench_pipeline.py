"""The pipeline benchmark's pure parts: the metadata wire and the target arithmetic (no GPU, no engine)."""

from __future__ import annotations

import datetime
import importlib.util
import socket
from pathlib import Path

import torch
import torch.distributed as td

_PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "scenarios" / "pipeline.py"
_spec = importlib.util.spec_from_file_location("bench_pipeline", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_wire_carries_metadata_and_zero_fills_payloads() -> None:
    port = _port()
    master = td.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=10)
    )
    a, b = bench.StoreWire(0, port, 10.0, small=8), bench.StoreWire(1, port, 10.0, small=8)
    for wire in (a, b):
        wire.begin("g1")
    a.send(torch.tensor([3, 1, 4], dtype=torch.int64), dst=1)
    a.isend(torch.full((16,), 7.0), dst=1).wait()
    a.send(torch.tensor(2.5), dst=1)  # 0-dim
    meta, big, scalar = torch.zeros(3, dtype=torch.int64), torch.full((16,), -1.0), torch.zeros(())
    b.recv(meta, src=0)
    b.irecv(big, src=0).wait()
    b.recv(scalar, src=0)
    assert meta.tolist() == [3, 1, 4]  # small messages travel
    assert torch.equal(big, torch.zeros(16))  # payloads are zero-filled, not copied
    assert float(scalar) == 2.5
    assert (a.messages, a.small_messages) == (3, 2)
    del master


def test_targets_and_comparison() -> None:
    model = dict(bench.SMOKE, seq=4, hidden=8)
    act = bench.activation_bytes(model, 2)
    assert act == 3 * 4 * 8 * 2
    gib = 2.0**30

    def rec(impl: str, gas: int, stage: int, peak_bytes: float, tps: float) -> dict:
        return {
            "impl": impl,
            "gas": gas,
            "stage": stage,
            "status": "ok",
            "peak_alloc_gib": peak_bytes / gib,
            "peak_reserved_gib": peak_bytes / gib,
            "step_s": 1.0,
            "tokens_per_s": tps,
            "stage_layers": 2,
        }

    records = [
        rec("ours", 1, 0, 1000, 10),
        rec("ours", 4, 0, 1000 + act, 30),
        rec("ours", 1, 1, 500, 10),
        rec("ours", 4, 1, 500, 31),
        rec("upstream", 1, 0, 1000, 9),
        rec("upstream", 4, 0, 1000 + 3 * act, 20),
        rec("upstream", 1, 1, 500, 9),
        rec("upstream", 4, 1, 500 + 3 * act, 25),
    ]
    summary = bench.summarize(records, model)
    ours = {row["gas"]: row for row in summary["per_impl"]["ours"]}
    assert ours[4]["s0"]["allowed_growth_bytes"] == act  # (min(P - 0, G) - 1) micro-batches, P = 2
    assert ours[4]["s0"]["meets_target"] and ours[4]["s1"]["meets_target"]
    up = {row["gas"]: row for row in summary["per_impl"]["upstream"]}
    assert up[4]["s0"]["meets_target"] is False  # three micro-batches of growth on the first stage
    versus = {row["gas"]: row for row in summary["vs_upstream"]}
    assert versus[4]["s0_at_or_below_upstream"] and versus[4]["s1_at_or_below_upstream"]
    assert versus[4]["tokens_per_s_ours"] == 30 and versus[4]["tokens_per_s_upstream"] == 20
    assert "| ours | 4 | 0 |" in bench.to_markdown(summary, records)
