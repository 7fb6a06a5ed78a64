"""Shim for tools that still call setup.py; everything lives in pyproject.toml."""
from setuptools import setup

setup()
