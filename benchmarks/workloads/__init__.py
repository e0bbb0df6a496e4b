"""What the benchmarks run: tasks, models and the kernels as workloads."""
