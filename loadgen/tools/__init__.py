"""Tools around the load generator: the fake server, the soak, benchmarks."""
