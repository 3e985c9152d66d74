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
    benchmarks/                    one module per `python -m cs336_inference bench NAME`
"""

from .workshop import openmp  # noqa: F401  (first: sets OpenMP's wait policy before torch is imported)
from .device import apply_thread_policy, default_dtype, get_device, seed_everything
from .generation import (GenerationResult, decode_one_token, expected_speedup, expected_tokens_per_pass, generate,
                         prefill, sample_next_token, speculative_accept, speculative_generate)
from .model import (ByteTokenizer, KVCache, ModelConfig, TransformerLM, load_cs336_checkpoint, load_pretrained,
                    load_tokenizer, scaled_dot_product_attention, verify_checkpoint)
from . import quantization  # noqa: F401,E402  (registers load_pretrained's weights="gguf-exact")

__version__ = "0.1.0"

__all__ = [
    "ByteTokenizer", "GenerationResult", "KVCache", "ModelConfig", "TransformerLM", "apply_thread_policy",
    "decode_one_token", "default_dtype", "expected_speedup", "expected_tokens_per_pass", "generate", "get_device",
    "load_cs336_checkpoint", "load_pretrained", "load_tokenizer", "prefill", "sample_next_token",
    "scaled_dot_product_attention", "seed_everything", "speculative_accept", "speculative_generate",
    "verify_checkpoint",
]
