"""`bench quantization_smollm2`: declared in `quantization`, beside `bench quantization`."""
from .quantization import bench_quantization_smollm2 as BENCHMARK  # noqa: F401
