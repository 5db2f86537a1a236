"""Benchmarks users run (``python -m benchmarks.throughput``, ``benchmarks.serve``, the soak) and the kernel
microbenchmarks the performance docs cite. They run as their own processes and import the runtime, never tests/."""
