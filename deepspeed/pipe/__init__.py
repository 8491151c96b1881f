"""``deepspeed.pipe``: build a pipeline-parallel model from layer specs (``PipelineModule``, ``LayerSpec``,
``TiedLayerSpec``); ``deepspeed.initialize`` returns a ``PipelineEngine`` for it. See docs/pipeline.md."""

from deepspeed.runtime.pipe import LayerSpec, PipelineModule, ProcessTopology, TiedLayerSpec

__all__ = ["PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology"]
