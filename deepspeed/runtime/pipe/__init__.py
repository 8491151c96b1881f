"""Pipeline parallelism (``deepspeed.runtime.pipe``): module, topology, schedules; the engine is in ``.engine``."""

from deepspeed.runtime.pipe.module import LayerSpec, PipelineModule, TiedLayerSpec
from deepspeed.runtime.pipe.topology import ProcessTopology

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology"]
