"""The registry of graded functions: the one list the autograder, the reference solution and the
student skeleton share.

`reference/` (one module per area) defines each graded function (or class) once, with the exact
signature and the shape-annotated docstring a student sees, and marks it with `@graded(area)`. From that:
- `tests/adapters.py` resolves each name in the implementation under test (the reference by default,
  a student's package with `--impl` / `CS336_INFERENCE_IMPL`);
- `python -m cs336_inference homework init DIR` writes the skeleton (same signatures and docstrings,
  bodies `raise NotImplementedError`), one module per area.
"""

from __future__ import annotations

from dataclasses import dataclass

# area -> (module name in the student's package, what the area covers)
AREAS: dict[str, tuple[str, str]] = {
    "layers": ("layers", "the Transformer's building blocks: RMSNorm, the SwiGLU feed-forward, and the handout's "
                         "ablations: a post-norm block and QK-norm attention"),
    "sampling": ("sampling", "turning logits into the next token: temperature, top-k, top-p, sampling"),
    "generation": ("generation", "the generation loop: greedy decoding of a batch with stop tokens"),
    "speculative": ("speculative", "speculative sampling: the accept/resample rule, its residual, greedy verification"),
    "attention": ("attention", "grouped-query attention, KV caches, MLA, sliding windows and their rolling buffer"),
    "alternatives": ("alternatives", "alternatives to the Transformer: one step of a fixed-state layer's recurrence "
                                     "(linear attention, Mamba-2's SSD)"),
    "quantization": ("quantization", "quantize/dequantize, int4 packing, an int8 KV cache, LLM.int8(), GPTQ, AWQ, "
                                     "QAT's straight-through estimator"),
    "serving": ("serving", "paged KV memory: block allocator and manager (fork, copy-on-write), paged attention, "
                           "continuous batching, the engine's num_computed_tokens bookkeeping"),
    "accounting": ("accounting", "FLOPs, bytes, latency and throughput: numeric and symbolic (sympy)"),
    "data": ("data", "the training batch sampler and bits per byte"),
    "compression": ("compression", "pruning (which structures to keep) and the distillation loss"),
}


# Graded names that were renamed, former -> current, so that each concept has one name in the library and the
# graded API. The grader still finds a class under its former name in a package written to an older skeleton
# (tests/adapters.py); the skeleton writes only the current names.
FORMER_NAMES: dict[str, str] = {
    "KVCache": "ContiguousKVCache",     # one layer's cache; `KVCache` is the model-wide cache of every layer
    "RollingKVBuffer": "RollingKVCache",
    "BlockManager": "KVCacheManager",
}


@dataclass(frozen=True)
class GradedEntry:
    name: str      # the function's (or class's) name in the reference and in a student's package
    area: str      # a key of AREAS
    obj: object    # the reference implementation

    @property
    def kind(self) -> str:
        return "class" if isinstance(self.obj, type) else "function"


GRADED: dict[str, GradedEntry] = {}


def graded(area: str):
    """Mark a reference function or class as graded in `area` (registration order = skeleton order)."""
    if area not in AREAS:
        raise ValueError(f"unknown area {area!r}; allowed: {sorted(AREAS)}")

    def register(obj):
        name = obj.__name__
        if name in GRADED:
            raise ValueError(f"graded name {name!r} registered twice")
        GRADED[name] = GradedEntry(name, area, obj)
        return obj
    return register
