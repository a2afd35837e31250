"""Benchmark harnesses (`inflight bench ...`)."""
