"""Benchmarks: kernels, DDP step time, training; run with ``signmuon-bench`` or ``python -m signmuon.benchmarks``."""
