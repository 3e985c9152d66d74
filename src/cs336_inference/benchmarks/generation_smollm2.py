"""`bench generation_smollm2`: declared in `generation`, beside `bench generation`."""
from .generation import bench_generation_smollm2 as BENCHMARK  # noqa: F401
