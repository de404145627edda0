"""The package version (its own module, so that writers can record it without importing the package)."""

__version__ = "0.1.0"
