"""Version checks integrations run (spec 1.15) pass against the installed distribution.

Transformers and Accelerate read the *distribution* metadata (``importlib.metadata``); TRL parses
``deepspeed.__version__``. Both must name the same version, and it must unlock every gate (>= 0.18.2).
"""

from __future__ import annotations

import importlib.metadata

from packaging import version

# The highest minimum any integration checks (Accelerate's Ulysses/ALST sequence-parallel path), and the others.
GATES = ("0.3.1", "0.5.5", "0.9.3", "0.11.0", "0.14.0", "0.14.3", "0.14.4", "0.14.5", "0.15.2", "0.16.4", "0.18.2")


def test_distribution_metadata_passes_every_gate() -> None:
    installed = version.parse(importlib.metadata.version("deepspeed"))
    failing = [gate for gate in GATES if not installed >= version.parse(gate)]
    assert not failing, f"installed deepspeed {installed} fails the integration gates {failing}"
    assert importlib.metadata.metadata("deepspeed")["Name"] == "deepspeed"  # transformers' is_deepspeed_available


def test_dunder_version_matches_metadata() -> None:
    import deepspeed

    assert deepspeed.__version__ == importlib.metadata.version("deepspeed")
    assert version.parse(deepspeed.__version__) >= version.parse("0.16.4")  # TRL's check


def test_version_components_are_ints() -> None:
    import deepspeed

    parsed = version.parse(deepspeed.__version__)
    parts = (deepspeed.__version_major__, deepspeed.__version_minor__, deepspeed.__version_patch__)
    assert all(type(p) is int for p in parts), parts
    assert parts == (parsed.major, parsed.minor, parsed.micro)
    assert isinstance(deepspeed.__git_hash__, str) and isinstance(deepspeed.__git_branch__, str)
