"""The version of zeus_callbacks (read by pyproject.toml and the package root)."""

__version__ = "0.1.0"
