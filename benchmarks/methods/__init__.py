"""The methods the benchmarks compare: one registry, and how each command builds a method."""
