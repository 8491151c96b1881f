"""Process topologies and the pipeline grid (``deepspeed.runtime.pipe.topology``).

Implementation: :mod:`deepspeed._core.pipe.topology`.
"""

from deepspeed._core.pipe.topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = ["ProcessTopology", "PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid"]
