"""Pipeline schedules and their instructions (``deepspeed.runtime.pipe.schedule``).

Implementation: :mod:`deepspeed._core.pipe.schedule`.
"""

from deepspeed._core.pipe.schedule import (
    BackwardPass,
    BufferOpInstruction,
    DataParallelSchedule,
    ForwardPass,
    InferenceSchedule,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
)

__all__ = [
    "PipeInstruction",
    "OptimizerStep",
    "ReduceGrads",
    "ReduceTiedGrads",
    "BufferOpInstruction",
    "LoadMicroBatch",
    "ForwardPass",
    "BackwardPass",
    "SendActivation",
    "RecvActivation",
    "SendGrad",
    "RecvGrad",
    "PipeSchedule",
    "TrainSchedule",
    "InferenceSchedule",
    "DataParallelSchedule",
]
