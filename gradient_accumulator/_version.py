"""The package version, in one place."""

__version__ = "0.6.0.dev0"
