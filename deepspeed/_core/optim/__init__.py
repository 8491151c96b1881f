"""Pieces every wrapped optimizer shares (stage 0 and ZeRO-1/2/3): the engine-facing base class, global-norm
clipping and reduction scaling. Below ``_core.checkpoint`` and ``_core.engine`` in the dependency order."""
