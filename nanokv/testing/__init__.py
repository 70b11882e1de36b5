"""Fixtures for tests and benchmarks: tiny random-weight checkpoints written by
transformers' save_pretrained (tiny.py), never used by the engine itself."""
