"""Benchmarks that need more than bench.py's one process (run through bench.py)."""
