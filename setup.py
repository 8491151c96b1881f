"""Thin setuptools shim; all metadata lives in pyproject.toml.

Kept because users (and some tooling) still run ``python setup.py develop`` or
``pip install -e .`` with legacy front-ends.
"""
from setuptools import setup

setup()
