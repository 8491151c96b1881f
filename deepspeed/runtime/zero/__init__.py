"""``deepspeed.zero`` / ``deepspeed.runtime.zero``: ZeRO-3 parameter partitioning entry points (upstream names)."""
from deepspeed.runtime.zero.partition_parameters import (
                                                         GatheredParameters,
                                                         Init,
                                                         ZeroParamStatus,
                                                         ZeroParamType,
                                                         register_external_parameter,
                                                         unregister_external_parameter,
)

__all__ = [
                                                         "GatheredParameters",
                                                         "Init",
                                                         "ZeroParamStatus",
                                                         "ZeroParamType",
                                                         "register_external_parameter",
                                                         "unregister_external_parameter",
]
