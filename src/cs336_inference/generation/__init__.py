"""Generation: sampling a token from logits, and prefill + decode with a KV cache.

`sampling` (temperature, top-k, top-p), `generate` (`prefill`, `decode_one_token`, `generate`),
`compiled` (`compile_decode`: a torch.compile'd decode step without graph breaks).
Speculative decoding will live here too.
"""

from .compiled import compile_decode
from .generate import GenerationResult, decode_one_token, generate, left_pad, prefill
from .sampling import logits_to_probs, sample_next_token

__all__ = ["GenerationResult", "compile_decode", "decode_one_token", "generate", "left_pad", "logits_to_probs",
           "prefill", "sample_next_token"]
