"""`bench speculative_draft`: declared in `speculative`, beside `bench speculative`."""
from .speculative import bench_speculative_draft as BENCHMARK  # noqa: F401
