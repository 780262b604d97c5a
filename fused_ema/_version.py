"""The package version (pyproject.toml reads it here; build_info() reports it)."""

__version__ = "0.1.0"
