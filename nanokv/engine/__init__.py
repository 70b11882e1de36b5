"""Torch-free engine policy: sequences, the paged block manager and the scheduler."""
