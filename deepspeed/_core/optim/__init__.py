"""Pieces every wrapped optimizer shares (stage 0 and ZeRO-1/2/3): the engine-facing base class, global-norm
clipping and reduction scaling. Below both ``_core.engine`` and ``_core.zero`` in the dependency order."""
