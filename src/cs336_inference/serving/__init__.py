"""Serving dynamic workloads: paged KV cache, schedulers (static / continuous batching), engine."""
