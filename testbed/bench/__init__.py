"""Benchmarks: collective micro-benchmark (``python -m testbed.bench``), trainer overhead."""
