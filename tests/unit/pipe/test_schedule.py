"""Pipeline schedules as data: replay every stage's stream together and check what the engine relies on."""

from __future__ import annotations

import itertools

import pytest

from deepspeed.runtime.pipe import schedule as sched

CASES = [(p, g) for p in (1, 2, 3, 4) for g in (1, 2, 3, 4, 5, 8)]
COMM = (sched.SendActivation, sched.RecvActivation, sched.SendGrad, sched.RecvGrad)


def _streams(cls: type, p: int, g: int) -> list[list[list[sched.PipeInstruction]]]:
    return [list(cls(micro_batches=g, stages=p, stage_id=s).steps()) for s in range(p)]


def _peer(stage: int, cmd: sched.PipeInstruction) -> tuple[int, str]:
    """The stage a comm instruction talks to and the message kind it carries."""
    if isinstance(cmd, sched.SendActivation):
        return stage + 1, "act"
    if isinstance(cmd, sched.RecvActivation):
        return stage - 1, "act"
    if isinstance(cmd, sched.SendGrad):
        return stage - 1, "grad"
    return stage + 1, "grad"


class _Replay:
    """Runs all stages' streams with rendezvous semantics: a send and its receive complete together.

    Each stage tracks which micro-batch sits in each buffer, so the test can check that what is sent is what the
    receiver expects, that forwards and backwards come in micro-batch order and that buffers never hold two live
    micro-batches.
    """

    def __init__(self, streams: list[list[list[sched.PipeInstruction]]], g: int) -> None:
        self.p, self.g = len(streams), g
        self.flat = [[(t, c) for t, step in enumerate(s) for c in step] for s in streams]
        self.pc = [0] * self.p
        self.buffers: list[dict[int, int]] = [{} for _ in range(self.p)]  # buffer -> live micro-batch
        self.fwd: list[list[int]] = [[] for _ in range(self.p)]
        self.bwd: list[list[int]] = [[] for _ in range(self.p)]
        self.next_fwd = [0] * self.p
        self.max_live = [0] * self.p
        self.inbox: list[int | None] = [None] * self.p  # micro-batch a RecvActivation delivered

    def _current(self, s: int) -> tuple[int, sched.PipeInstruction] | None:
        return self.flat[s][self.pc[s]] if self.pc[s] < len(self.flat[s]) else None

    def run(self) -> None:
        while any(self._current(s) is not None for s in range(self.p)):
            progressed = False
            for s in range(self.p):
                while (item := self._current(s)) is not None and not isinstance(item[1], COMM):
                    self._compute(s, item[1])
                    self.pc[s] += 1
                    progressed = True
            for s in range(self.p):
                item = self._current(s)
                if item is None or not isinstance(item[1], (sched.SendActivation, sched.SendGrad)):
                    continue
                peer, kind = _peer(s, item[1])
                other = self._current(peer)
                assert other is not None, f"stage {s} sends to a finished stage"
                if (
                    isinstance(other[1], COMM)
                    and _peer(peer, other[1]) == (s, kind)
                    and not isinstance(other[1], type(item[1]))
                ):
                    assert other[0] == item[0], f"send at step {item[0]} met its receive at step {other[0]}"
                    self._transfer(s, item[1], peer, other[1])
                    self.pc[s] += 1
                    self.pc[peer] += 1
                    progressed = True
            assert progressed, f"deadlock: stages wait at {[self._current(s) for s in range(self.p)]}"

    def _transfer(self, src: int, send: sched.PipeInstruction, dst: int, recv: sched.PipeInstruction) -> None:
        mb = self.buffers[src][send.buffer_id]
        if isinstance(send, sched.SendActivation):
            assert mb == self.next_fwd[dst], "activation of the wrong micro-batch"
            assert recv.buffer_id not in self.buffers[dst], "received into a buffer still in use"
            self.buffers[dst][recv.buffer_id] = mb
        else:
            assert self.buffers[dst].get(recv.buffer_id) == mb, "gradient for the wrong micro-batch"
            assert mb in self.bwd[src], "sent a gradient before the backward that makes it"
            del self.buffers[src][send.buffer_id]

    def _compute(self, s: int, cmd: sched.PipeInstruction) -> None:
        bufs = self.buffers[s]
        if isinstance(cmd, sched.LoadMicroBatch) and s == 0:
            assert cmd.buffer_id not in bufs, "loaded into a live buffer"
            bufs[cmd.buffer_id] = self.next_fwd[s]
        elif isinstance(cmd, sched.ForwardPass):
            assert bufs.get(cmd.buffer_id) == self.next_fwd[s], "forward without its input"
            self.fwd[s].append(self.next_fwd[s])
            self.next_fwd[s] += 1
            self.max_live[s] = max(self.max_live[s], len(bufs))
        elif isinstance(cmd, sched.BackwardPass):
            mb = bufs[cmd.buffer_id]
            assert mb in self.fwd[s] and mb not in self.bwd[s], "backward before forward, or twice"
            self.bwd[s].append(mb)
            if s == 0:  # nothing to send back: the buffer is free
                del bufs[cmd.buffer_id]


@pytest.mark.parametrize("p, g", CASES)
def test_train_schedule_replays_without_deadlock(p: int, g: int) -> None:
    streams = _streams(sched.TrainSchedule, p, g)
    replay = _Replay(streams, g)
    replay.run()
    for s in range(p):
        assert replay.fwd[s] == list(range(g)), f"stage {s} forwards {replay.fwd[s]}"
        assert replay.bwd[s] == list(range(g)), f"stage {s} backwards {replay.bwd[s]}"
        assert replay.max_live[s] == min(p - s, g), f"stage {s} held {replay.max_live[s]} micro-batches"
        assert not replay.buffers[s], f"stage {s} ends with live buffers {replay.buffers[s]}"


@pytest.mark.parametrize("p, g", CASES)
def test_train_schedule_shape(p: int, g: int) -> None:
    for s in range(p):
        schedule = sched.TrainSchedule(micro_batches=g, stages=p, stage_id=s)
        steps = list(schedule.steps())
        assert len(steps) == 2 * (g + p - 1)
        assert schedule.num_pipe_buffers() == min(p - s, g)
        flat = list(itertools.chain.from_iterable(steps))
        assert sum(isinstance(c, sched.ForwardPass) for c in flat) == g
        assert sum(isinstance(c, sched.BackwardPass) for c in flat) == g
        loads = sum(isinstance(c, sched.LoadMicroBatch) for c in flat)
        assert loads == (g if s in (0, p - 1) else 0)
        assert steps[-1][-3:] == [sched.ReduceTiedGrads(), sched.ReduceGrads(), sched.OptimizerStep()]
        assert all(c.buffer_id < schedule.num_pipe_buffers() for c in flat if isinstance(c, sched.BufferOpInstruction))
        for step in steps:  # at most one pass per step
            assert sum(isinstance(c, (sched.ForwardPass, sched.BackwardPass)) for c in step) <= 1
        if s == 0:
            assert not any(isinstance(c, (sched.RecvActivation, sched.SendGrad)) for c in flat)
        if s == p - 1:
            assert not any(isinstance(c, (sched.SendActivation, sched.RecvGrad)) for c in flat)


def test_two_stage_stream_exact() -> None:
    """The 1F1B pattern for P=2, G=3, written out."""
    f, b, load = sched.ForwardPass, sched.BackwardPass, sched.LoadMicroBatch
    first = list(sched.TrainSchedule(3, 2, 0).steps())
    assert first[:6] == [
        [load(0), f(0)],
        [sched.SendActivation(0)],
        [load(1), f(1)],
        [sched.RecvGrad(0), sched.SendActivation(1), b(0)],
        [load(0), f(0)],
        [sched.RecvGrad(1), sched.SendActivation(0), b(1)],
    ]
    last = list(sched.TrainSchedule(3, 2, 1).steps())
    assert last[1] == [sched.RecvActivation(0), load(0), f(0)]
    assert last[2] == [b(0)]
    assert last[3] == [sched.SendGrad(0), sched.RecvActivation(0), load(0), f(0)]


@pytest.mark.parametrize("p, g", CASES)
def test_inference_schedule_replays(p: int, g: int) -> None:
    streams = _streams(sched.InferenceSchedule, p, g)
    flat = [[(t, c) for t, step in enumerate(st) for c in step] for st in streams]
    # Rendezvous replay of sends/receives only, checking the micro-batch order they carry.
    pcs, sent = [0] * p, [[] for _ in range(p)]
    while any(pcs[s] < len(flat[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pcs[s] < len(flat[s]) and not isinstance(flat[s][pcs[s]][1], COMM):
                pcs[s] += 1
                progressed = True
            if pcs[s] < len(flat[s]) and isinstance(flat[s][pcs[s]][1], sched.SendActivation):
                nxt = pcs[s + 1]
                if nxt < len(flat[s + 1]) and isinstance(flat[s + 1][nxt][1], sched.RecvActivation):
                    assert flat[s + 1][nxt][0] == flat[s][pcs[s]][0]
                    sent[s].append(flat[s][pcs[s]][0])
                    pcs[s] += 1
                    pcs[s + 1] += 1
                    progressed = True
        assert progressed, "inference schedule deadlocks"
    for s in range(p):
        forwards = [c for step in streams[s] for c in step if isinstance(c, sched.ForwardPass)]
        assert [c.buffer_id for c in forwards] == [m % min(2, g) for m in range(g)]
        assert len(sent[s]) == (g if s < p - 1 else 0)
        assert not any(isinstance(c, (sched.BackwardPass, sched.OptimizerStep)) for st in streams[s] for c in st)


def test_data_parallel_schedule() -> None:
    steps = list(sched.DataParallelSchedule(micro_batches=3, stages=1, stage_id=0).steps())
    assert len(steps) == 3
    assert steps[0] == [sched.LoadMicroBatch(0), sched.ForwardPass(0), sched.BackwardPass(0)]
    assert steps[-1][-2:] == [sched.ReduceGrads(), sched.OptimizerStep()]


def test_instruction_equality_and_attributes() -> None:
    a = sched.ForwardPass(buffer_id=2)
    assert a.buffer_id == 2 and a.name == "ForwardPass" and repr(a) == "ForwardPass(buffer_id=2)"
    assert a == sched.ForwardPass(2) and a != sched.BackwardPass(2) and a != sched.ForwardPass(1)
    assert len({a, sched.ForwardPass(2)}) == 1
    assert sched.PipeInstruction(x=1).x == 1


def test_schedule_properties_and_errors() -> None:
    s = sched.TrainSchedule(micro_batches=4, stages=3, stage_id=2)
    assert (s.stage, s.num_stages, s.num_micro_batches, s.is_first_stage, s.is_last_stage) == (2, 3, 4, False, True)
    for bad in [dict(micro_batches=0, stages=2, stage_id=0), dict(micro_batches=2, stages=2, stage_id=2)]:
        with pytest.raises(ValueError):
            sched.TrainSchedule(**bad)
