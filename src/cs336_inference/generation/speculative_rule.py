"""The accept/resample rule of speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

A draft with distribution p proposed tokens x_1..x_g; the target's distributions q_1..q_{g+1} at the
same positions came from one parallel forward. Walk left to right: accept x_i with probability
min(1, q_i(x_i) / p_i(x_i)); at the first rejection emit a sample from the residual
norm(max(q_i - p_i, 0)) and stop; if all g are accepted, emit a bonus sample from q_{g+1}.

Why the output is an exact sample from q: token x comes out of position i either by being proposed
and accepted, p(x) min(1, q(x)/p(x)) = min(p(x), q(x)), or by a rejection (total probability
1 - sum_y min(p(y), q(y))) followed by the residual, whose mass at x is (q(x) - min(p(x), q(x)))
divided by exactly that total. The two add to q(x). `speculative_theory` does this sum in exact
fractions; the tests check it by enumeration and by sampling.

At temperature 0, p and q are one-hot: a draft token is accepted iff it is the target's argmax and
the residual is the one-hot on that argmax, so the rule reduces to greedy verification.

A draft tree offers several candidates for one position; `accept_among_candidates` applies the rule to
them one after another, each against the residual the previous rejection left (exact when the
candidates were drawn from the draft without replacement).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import _checks


class Acceptance(NamedTuple):
    """num_accepted: how many leading draft tokens were kept (0..g); next_token: the token emitted after
    them (a residual sample at the first rejection, or the bonus token when all g were kept)."""

    num_accepted: int
    next_token: int


def acceptance_probability(p_draft: torch.Tensor, q_target: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """min(1, q_i(x_i) / p_i(x_i)) for each proposed token: p_draft, q_target (g, V), draft_tokens (g,) -> (g,).

    A token the draft could not have proposed (p = 0) is accepted iff the target allows it (q > 0).
    """
    index = draft_tokens.long()[:, None]
    p = p_draft.gather(-1, index)[:, 0]
    q = q_target.gather(-1, index)[:, 0]
    ratio = torch.where(p > 0, q / p.clamp_min(torch.finfo(p.dtype).tiny), (q > 0).to(q.dtype))
    return ratio.clamp(max=1.0)


def residual_distribution(p_draft: torch.Tensor, q_target: torch.Tensor) -> torch.Tensor:
    """norm(max(q - p, 0)) over the last dim: what to sample after a rejection.

    Where q <= p everywhere (only possible when p == q), a rejection has probability zero; we return q
    so a caller that rounds differently still gets a valid distribution.
    """
    residual = (q_target - p_draft).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), q_target)


def _check_accept_args(p_draft, q_target, draft_tokens) -> None:
    for name, x in (("p_draft", p_draft), ("q_target", q_target)):
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating-point torch.Tensor of probabilities, got "
                            f"{type(x).__name__ if not isinstance(x, torch.Tensor) else x.dtype}")
    if (not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dtype.is_floating_point
            or draft_tokens.dtype == torch.bool):
        raise TypeError("draft_tokens must be an integer torch.Tensor of shape (g,)")
    if p_draft.dim() != 2 or draft_tokens.dim() != 1 or draft_tokens.shape[0] != p_draft.shape[0]:
        raise ValueError(f"p_draft must be (g, V) and draft_tokens (g,) with the same g, got "
                         f"{tuple(p_draft.shape)} and {tuple(draft_tokens.shape)}")
    g, V = p_draft.shape
    if q_target.dim() != 2 or q_target.shape[0] != g + 1:
        raise ValueError(f"q_target must be (g + 1, V) = ({g + 1}, V): the target's distribution at each "
                         f"proposed position plus the bonus position, got {tuple(q_target.shape)}")
    if q_target.shape[1] != V:
        raise ValueError(f"draft and target vocabularies differ: p_draft has V = {V}, q_target has "
                         f"V = {q_target.shape[1]}; speculative sampling needs a shared vocabulary")
    if g and (int(draft_tokens.min()) < 0 or int(draft_tokens.max()) >= V):
        raise ValueError(f"draft_tokens must be in [0, V={V}), got {draft_tokens.tolist()}")
    for name, x in (("p_draft", p_draft), ("q_target", q_target)):
        _check_distributions(name, x)


def _check_distributions(name: str, x: torch.Tensor, tolerance: float = 1e-3) -> None:
    """Each row a probability distribution: finite, >= 0, summing to 1 (within `tolerance`, as fp32
    softmax rows do). Logits or unnormalised weights would be sampled as if they were probabilities."""
    if x.numel() == 0:
        return
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} must hold probabilities, got NaN or inf")
    if bool((x < 0).any()):
        raise ValueError(f"{name} must hold probabilities (>= 0), got a minimum of {float(x.min()):.4g}: logits? "
                         f"pass softmax(logits), or logits_to_probs(...) for the sampling distribution")
    sums = x.double().sum(-1)
    worst = int((sums - 1).abs().argmax())
    if abs(float(sums[worst]) - 1) > tolerance:
        raise ValueError(f"each row of {name} must sum to 1 (a distribution over V), got row {worst} summing to "
                         f"{float(sums[worst]):.6g}")


def speculative_accept(p_draft: torch.Tensor, q_target: torch.Tensor, draft_tokens: torch.Tensor,
                       generator: torch.Generator | None = None) -> Acceptance:
    """The exact accept/resample rule. p_draft (g, V): the draft's distribution at each proposed
    position; q_target (g + 1, V): the target's, plus the bonus position; draft_tokens (g,).

    Returns `Acceptance(num_accepted, next_token)`: emit draft_tokens[:num_accepted] then next_token.
    g = 0 is allowed (nothing proposed: just a sample from q_target[0]).
    """
    _check_accept_args(p_draft, q_target, draft_tokens)
    _checks.generator("generator", generator)
    return accept_unchecked(p_draft, q_target, draft_tokens, generator)


def accept_unchecked(p_draft: torch.Tensor, q_target: torch.Tensor, draft_tokens: torch.Tensor,
                     generator: torch.Generator | None = None) -> Acceptance:
    """`speculative_accept` without validating its arguments (the decoding loop builds them itself,
    and every check costs a host-device round trip per pass)."""
    if generator is not None and generator.device != p_draft.device:
        p_draft, q_target, draft_tokens = (t.to(generator.device) for t in (p_draft, q_target, draft_tokens))
    g = draft_tokens.shape[0]
    accept = acceptance_probability(p_draft, q_target[:g], draft_tokens)                      # (g,)
    uniforms = torch.rand(g, generator=generator, device=p_draft.device, dtype=accept.dtype)  # (g,)
    rejected = (uniforms >= accept).tolist()  # u < a happens with probability a
    k = rejected.index(True) if True in rejected else g
    dist = q_target[g] if k == g else residual_distribution(p_draft[k], q_target[k])
    token = int(torch.multinomial(dist, 1, generator=generator))
    return Acceptance(k, token)


def greedy_accept(draft_tokens: list[int], target_argmax: list[int]) -> Acceptance:
    """The temperature-0 case of the rule (no randomness): keep draft tokens while each equals the
    target's argmax at its position, then emit the target's argmax. target_argmax has g + 1 entries."""
    k = 0
    while k < len(draft_tokens) and draft_tokens[k] == target_argmax[k]:
        k += 1
    return Acceptance(k, target_argmax[k])


def accept_among_candidates(p_draft: torch.Tensor, q_target: torch.Tensor, candidates: list[int],
                            generator: torch.Generator | None = None) -> tuple[int | None, int]:
    """The rule for several candidates at one position (a draft tree's children), drawn one after another
    *without replacement* from p_draft (V,): candidates[0] from p, candidates[1] from p with candidates[0]
    removed and renormalised, and so on. q_target (V,): the target's distribution there.

    Try them in draw order: accept candidate i with probability min(1, q_i(x_i) / p_i(x_i)); on a rejection,
    q_{i+1} = norm(max(q_i - p_i, 0)) (the residual, as in the one-candidate rule) and p_{i+1} is p_i with
    x_i removed. Each step is the one-candidate rule against the current target q_i, whose output is an
    exact sample of q_i; what follows a rejection is an exact sample of the residual q_{i+1} whatever x_i
    was, because x_{i+1} is drawn from p_{i+1} given x_i. So the output is an exact sample of q_target.

    Returns (the index of the accepted candidate, its token), or (None, a sample of the last residual)
    when every candidate is rejected. A candidate list that ran out of draft mass ends there.
    """
    for name, x in (("p_draft", p_draft), ("q_target", q_target)):
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point or x.dim() != 1:
            raise TypeError(f"{name} must be a 1-D floating-point torch.Tensor of probabilities (V,), got "
                            f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if q_target.shape != p_draft.shape:
        raise ValueError(f"p_draft and q_target must cover one vocabulary, got V = {p_draft.shape[0]} and "
                         f"{q_target.shape[0]}")
    V = p_draft.shape[0]
    tokens = _checks.token_list("candidates", candidates)
    if any(t < 0 or t >= V for t in tokens) or len(set(tokens)) != len(tokens):
        raise ValueError(f"candidates must be distinct tokens in [0, V={V}) (draws without replacement), got {tokens}")
    for name, x in (("p_draft", p_draft), ("q_target", q_target)):
        _check_distributions(name, x[None])
    _checks.generator("generator", generator)
    return among_candidates_unchecked(p_draft, q_target, tokens, generator)


def among_candidates_unchecked(p_draft: torch.Tensor, q_target: torch.Tensor, candidates: list[int],
                               generator: torch.Generator | None = None) -> tuple[int | None, int]:
    """`accept_among_candidates` without validating its arguments (a tree's walk builds them itself)."""
    device = generator.device if generator is not None else torch.device("cpu")
    p, q = p_draft.to(device, torch.float64).clone(), q_target.to(device, torch.float64)
    for i, token in enumerate(candidates):
        if p[token] <= 0:   # the draft could not have drawn it: its draws ended before
            break
        if float(torch.rand((), generator=generator, dtype=torch.float64, device=device)) < float(q[token] / p[token]):
            return i, token
        q = residual_distribution(p, q)
        p[token] = 0.0
        if p.sum() <= 0:
            break
        p = p / p.sum()
    return None, int(torch.multinomial(q.float(), 1, generator=generator))
