"""The package's version and the name it is installed by, each written once."""

__version__ = "0.1.0"
"""This release; the build reads it from here, and ``collective.__version__`` re-exports it."""

DISTRIBUTION = "ray-collective"
"""The name pip installs this package by (``collective`` on PyPI is another project)."""
