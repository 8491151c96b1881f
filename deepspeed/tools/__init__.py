"""Tools that run beside training rather than inside it (analysis of what a run recorded).

Nothing under ``deepspeed/_core`` imports this package (``tests/lint/test_tools_layering.py``); the engine façade
may hand a tool to the core through an interface the core defines.
"""
