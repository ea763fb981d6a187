"""Benchmarks that print tables and write JSON and PNG results (``python -m benchmarks.<name>``)."""
