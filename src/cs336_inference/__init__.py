"""cs336_inference: the executable companion to CS336 Lecture 10 (Inference).

Every algorithm lives once in this package; `lecture/`, `notebooks/` and `tests/` import it.
One sub-package per part of the lecture, imports pointing downward only:

    device, timing, figures        where things run, how they are timed, where outputs go
    model/                         config, layers, attention variants, KV caches, TransformerLM,
                                   checkpoints, tokenizers
    generation/                    sampling, prefill/decode/generate, speculative decoding
    accounting/                    FLOPs, bytes, intensity (numeric + symbolic), hardware, roofline
    quantization/                  int8/int4/fp8, LLM.int8(), GPTQ, AWQ, QAT, quantized models
    data/                          offline corpus, training, evaluation
    compression/                   pruning, distillation
    serving/                       paged KV cache, schedulers, engine
    homework/                      the graded functions' reference solution and the student skeleton
    workshop/                      the performance workshop (the core never imports it): the CLI's fast
                                   path, CPU tuning, OpenMP policy, our C++ kernels, the benchmarks
"""

import importlib

# The names below are the package's top level: importing `cs336_inference` itself imports nothing else
# (no torch, no environment change), so `python -m cs336_inference` can apply OpenMP's wait policy before
# torch loads (`__main__`, `workshop/openmp.py`). The first of these names a program reads imports them all.
_EXPORTS = {
    "device": ("apply_thread_policy", "default_dtype", "get_device", "seed_everything"),
    "generation": ("GenerationResult", "decode_one_token", "expected_speedup", "expected_tokens_per_pass", "generate",
                   "prefill", "sample_next_token", "speculative_accept", "speculative_generate"),
    "model": ("ByteTokenizer", "KVCache", "ModelConfig", "TransformerLM", "load_cs336_checkpoint", "load_pretrained",
              "load_tokenizer", "scaled_dot_product_attention", "verify_checkpoint"),
    "quantization": (),   # registers load_pretrained's weights="gguf-exact"
}


def _load_exports() -> None:
    for part, names in _EXPORTS.items():
        module = importlib.import_module(f".{part}", __name__)
        globals().update({name: getattr(module, name) for name in names})


def __getattr__(name: str):   # PEP 562: runs only for a name not set yet
    if any(name in names for names in _EXPORTS.values()):
        _load_exports()
        return globals()[name]
    if not name.startswith("_"):   # a part of the package (`cs336_inference.serving`) imports on first use
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__version__ = "0.1.0"

__all__ = [
    "ByteTokenizer", "GenerationResult", "KVCache", "ModelConfig", "TransformerLM", "apply_thread_policy",
    "decode_one_token", "default_dtype", "expected_speedup", "expected_tokens_per_pass", "generate", "get_device",
    "load_cs336_checkpoint", "load_pretrained", "load_tokenizer", "prefill", "sample_next_token",
    "scaled_dot_product_attention", "seed_everything", "speculative_accept", "speculative_generate",
    "verify_checkpoint",
]
