"""The package version, on the ground floor so the CLI and the server can read it without importing
the whole package (`pagedllm/__init__.py` re-exports everything, the server included)."""

__version__ = "0.1.0"
