"""Generation: sampling a token from logits, and prefill + decode with a KV cache.

`sampling` (temperature, top-k, top-p), `generate` (`prefill`, `decode_one_token`, `generate`),
`chat` (streaming into a cache that persists across calls: `extend`, `stream`, `ChatSession`),
`compiled` (`compile_decode`: a torch.compile'd decode step without graph breaks).
Speculative decoding will live here too.
"""

from .chat import ChatSession, TextStream, extend, stream
from .compiled import compile_decode
from .generate import GenerationResult, decode_one_token, generate, left_pad, prefill
from .sampling import logits_to_probs, sample_next_token

__all__ = ["ChatSession", "GenerationResult", "TextStream", "compile_decode", "decode_one_token", "extend",
           "generate", "left_pad", "logits_to_probs", "prefill", "sample_next_token", "stream"]
