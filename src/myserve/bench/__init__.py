"""Benchmarks: engine-level throughput now; the HTTP load generator joins later."""
