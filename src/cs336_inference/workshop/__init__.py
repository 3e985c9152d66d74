"""The performance workshop: what makes the teaching core fast on a real machine, behind one door.

The teaching core (model/, generation/, serving/, quantization/, ...) is plain PyTorch and never imports
this package; the CLI's fast commands and the benchmarks do. They reach the core in three explicit ways,
each of which says what it did:

- `apply_openmp_policy()`: OpenMP's wait policy, set in the environment before torch is imported
  (`python -m cs336_inference` calls it first; see `openmp.py` for where and why);
- `register_kernels()`: our C++ kernels added to the core's kernel registries (the attention kernel
  "cpu", the int4 linear kernel "cs336 avx512-bf16"); importing `workshop.kernels` does it too;
- `tune(model)`: the CPU decode speed-ups applied to a model in place, as `fuse_projections` is applied
  (`cpu_tuning.tune_for_cpu`), returning the line that says what changed.

Inside:

    openmp.py       OpenMP's wait policy (applied by the CLI's entry point)
    cpu_tuning.py   opt-in CPU transforms of a model (few-row matmuls, one thread under contention)
    huge_pages.py   streamed weights moved onto 2 MB pages
    fast_path.py    the model chat/generate/serve run: weights, kernels, threads, compile
    startup.py      how the fast path starts quickly: cache folders, background compile, packed weights
    kernels/        Python wrappers of our C++ kernels (csrc/) and their registration
    peers/          the Hugging Face model the decode benchmarks compare with
    benchmarks/     one module per `python -m cs336_inference bench NAME`

This file imports nothing at import time (no torch), so `openmp` can run before torch loads.
"""

from __future__ import annotations


def apply_openmp_policy() -> dict[str, str]:
    """Set OpenMP's wait policy in the environment where it is unset, before torch is imported; returns
    the variables it set ({} when none, or when torch is loaded already: too late). See `openmp.py`."""
    from .openmp import apply_wait_policy

    return apply_wait_policy()


def register_kernels() -> dict[str, str]:
    """Register our CPU kernels into the core's registries (idempotent); returns {registry: name}."""
    from .kernels import register_kernels as register

    return register()


def tune(model, **options) -> str:
    """`cpu_tuning.tune_for_cpu(model, **options)` (in place, as `fuse_projections`), registering our
    kernels first; returns what it changed, in one line (`cpu_tuning.describe`)."""
    from .cpu_tuning import describe, tune_for_cpu

    register_kernels()
    return describe(tune_for_cpu(model, **options))


__all__ = ["apply_openmp_policy", "register_kernels", "tune"]
