"""What the benchmarks run: the tasks and the models."""
