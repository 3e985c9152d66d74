"""The reference solution, speculative: speculative sampling's accept/resample rule.

See the package docstring; each function is a thin wrapper over the library."""

from __future__ import annotations

import torch

from ...generation import speculative_rule as _rule
from ..registry import graded


@graded("speculative")
def speculative_accept(p_draft: torch.Tensor, q_target: torch.Tensor, draft_tokens: torch.Tensor,
                       generator: torch.Generator | None = None) -> tuple[int, int]:
    """Speculative sampling's accept/resample rule (Leviathan et al. 2023; Chen et al. 2023) for one pass.

    A draft model proposed g tokens x_1 .. x_g (draft_tokens (g,) int64), drawing x_i from p_draft[i - 1];
    one forward of the target gave q_target (g + 1, V): its distribution at each proposed position, plus
    one more. p_draft: (g, V) float probabilities. For i = 1 .. g, in order: accept x_i with probability
    min(1, q_i(x_i) / p_i(x_i)) (if p_i(x_i) = 0: accept iff q_i(x_i) > 0), using uniforms drawn from
    `generator`; at the first rejection draw the next token from the residual norm(max(q_i - p_i, 0)) and
    stop; if all g are accepted, draw a bonus token from q_{g+1}. g = 0 is allowed (a sample of q_1).
    Returns (num_accepted k in 0 .. g, next_token) as Python ints: the pass emits draft_tokens[:k], then
    next_token, and the emitted tokens are distributed exactly as sampling the target one token at a time.
    """
    out = _rule.speculative_accept(p_draft, q_target, draft_tokens, generator)
    return int(out.num_accepted), int(out.next_token)


@graded("speculative")
def residual_distribution(p_draft: torch.Tensor, q_target: torch.Tensor) -> torch.Tensor:
    """What speculative sampling draws from after rejecting a draft token: norm(max(q - p, 0)).

    p_draft, q_target: (..., V) probabilities. Returns (..., V): max(q - p, 0) divided by its sum over V;
    where that sum is 0 (only when q <= p everywhere, i.e. q == p: a rejection cannot happen), q itself.
    """
    return _rule.residual_distribution(p_draft, q_target)


@graded("speculative")
def greedy_verify(draft_tokens: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """Speculative decoding at temperature 0: verify g draft tokens against the target's argmaxes.

    draft_tokens: g ints; target_logits: (g + 1, V), the target's logits at each proposed position plus
    one more (row i predicts the token after the prefix and draft_tokens[:i]). Accept draft tokens while
    each equals the argmax of its row (ties: the lowest token id); at the first mismatch, or after all g,
    the next token is the argmax of the row reached. Returns (num_accepted k in 0 .. g, next_token) as
    Python ints: the pass emits draft_tokens[:k], then next_token (g = 0: just the argmax of row 0).
    """
    k, token = _rule.greedy_accept(list(draft_tokens), target_logits.argmax(-1).tolist())
    return int(k), int(token)
