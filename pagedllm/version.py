"""The package version, on the ground floor so the CLI and the server can read it without importing
torch (`pagedllm/__init__.py` loads its public names on first use)."""

__version__ = "0.1.0"
