"""Build shim: every piece of metadata lives in pyproject.toml's ``[project]`` table."""

from setuptools import setup

setup()
