"""Benchmarks: ``python -m myserve.bench`` (HTTP load generator for any OpenAI-compatible server)
and ``python -m myserve.bench.engine`` (engine throughput against transformers ``generate``)."""
