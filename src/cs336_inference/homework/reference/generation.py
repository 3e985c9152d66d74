"""The reference solution, generation: the greedy generation loop over a batch of prompts.

See the package docstring; the function is a thin wrapper over the library's `generate`."""

from __future__ import annotations

from ...generation import generate as _generate
from ..registry import graded


@graded("generation")
def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int,
                    stop_tokens: list[int] | None = None) -> list[list[int]]:
    """Greedy decoding of several prompts (of different lengths) with one model.

    model: a callable mapping token ids (B, T) int64 to logits (B, T, V), position t of each row
    predicting token t + 1, every row starting at position 0 (a `TransformerLM`; you may call it on the
    whole sequence at every step, without a cache). prompts: B lists of token ids (each non-empty).
    For each prompt, repeat max_new_tokens times: append the argmax of the logits at the last position
    (ties: the lowest token id). A sequence ends early right after it appends a token in stop_tokens
    (that token is part of its output); a stop token inside the prompt ends nothing.
    Returns B lists: the generated tokens of each prompt (prompt excluded), each at most max_new_tokens
    long. The answer must equal decoding each prompt alone, however the prompts are batched (if you
    batch prompts of different lengths, their positions must still start at 0).
    """
    result = _generate(model, [list(p) for p in prompts], max_new_tokens, temperature=0.0,
                                stop_tokens=stop_tokens)
    return [list(t) for t in result.tokens]
