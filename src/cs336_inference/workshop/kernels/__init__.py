"""Python wrappers of our C++ kernels (`../csrc/`), compiled once per machine on first use, and their
registration into the core's kernel registries.

- `cpu_attention`: builds the library; its decode attention is the attention kernel "cpu"
  (`model.attention.ATTENTION`);
- `cpu_int4`: an int4 matmul for a few rows, the int4 linear kernel "cs336 avx512-bf16"
  (`quantization.kernels.LINEAR`);
- `dense_prefill`: an int4 layer's prefill dequantization, compiled (an opt-in transform of a model).

Importing this package registers the kernels (using the workshop's kernels is asking for them);
`register_kernels()` is the explicit form, and says what it registered.
"""

from . import cpu_attention, cpu_int4


def register_kernels() -> dict[str, str]:
    """Register our CPU kernels into the core's registries (idempotent): {registry: name}. Where a kernel
    cannot run (no AVX512-BF16, no compiler) it is registered all the same: choosing it then says why, and
    int4 layers keep torch's kernel."""
    return {"attention": cpu_attention.register(), "int4 linear": cpu_int4.register()}


register_kernels()

__all__ = ["register_kernels"]
