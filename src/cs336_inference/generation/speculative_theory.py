"""What speculative decoding should gain, and why its output is exact (Leviathan et al. 2023, sec. 3).

Model: each draft token is accepted with the same probability alpha = sum_x min(p(x), q(x))
(= 1 - total variation distance), independently. A pass proposing gamma tokens then emits
1 + (number of leading acceptances) tokens, on average (1 - alpha^(gamma+1)) / (1 - alpha), and
costs gamma draft forwards plus one target forward over gamma + 1 tokens. With c = draft forward
time / target decode-step time and v = time of the target's (gamma+1)-token pass / one decode step
(v = 1 in the paper: decode is memory-bound, so a few more tokens per pass are free):
    speed-up = E[tokens per pass] / (gamma * c + v).

`speculative_output_distribution` is the lecture's proof by example, for any p and q: it adds up,
in exact fractions, the two ways each token can come out of one speculative step.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from numbers import Real

import torch


def _check_alpha(alpha) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, Real):
        raise TypeError(f"alpha must be a real number in [0, 1], got {type(alpha).__name__}")
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1] (a probability), got {alpha}")


def _check_gamma(gamma, minimum: int = 0) -> None:
    if isinstance(gamma, bool) or not isinstance(gamma, int):
        raise TypeError(f"gamma must be an int, got {type(gamma).__name__}")
    if gamma < minimum:
        raise ValueError(f"gamma must be >= {minimum}, got {gamma}")


def _check_nonnegative(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{name} must be finite and >= 0, got {value}")


def expected_tokens_per_pass(alpha, gamma: int):
    """(1 - alpha^(gamma+1)) / (1 - alpha): expected tokens one target pass emits (gamma + 1 at alpha = 1).

    Exact for Fractions. gamma = 0 (no drafts) gives 1: plain decoding.
    """
    _check_alpha(alpha)
    _check_gamma(gamma)
    if alpha == 1:
        return gamma + 1
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def expected_speedup(alpha, gamma: int, cost_ratio, verify_cost=1):
    """Expected wall-clock speed-up over plain decoding: E[tokens per pass] / (gamma * c + v).

    cost_ratio c: one draft forward / one target decode step; verify_cost v: the target's pass over
    gamma + 1 tokens / one decode step (1 when decode is memory-bound, larger when compute or
    per-token overhead matters).
    """
    _check_gamma(gamma)
    _check_nonnegative("cost_ratio", cost_ratio)
    _check_nonnegative("verify_cost", verify_cost)
    if verify_cost == 0 and gamma * cost_ratio == 0:
        raise ValueError("gamma * cost_ratio + verify_cost must be > 0 (a pass cannot be free)")
    return expected_tokens_per_pass(alpha, gamma) / (gamma * cost_ratio + verify_cost)


def optimal_gamma(alpha, cost_ratio, max_gamma: int = 64, verify_cost=1) -> int:
    """The gamma in 1..max_gamma with the largest expected speed-up (the smallest on ties)."""
    _check_gamma(max_gamma, minimum=1)
    return max(range(1, max_gamma + 1), key=lambda g: (expected_speedup(alpha, g, cost_ratio, verify_cost), -g))


def acceptance_rate(p, q) -> float | Fraction | torch.Tensor:
    """alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q): tensors (..., V) -> (...), or sequences -> a number.

    p and q must be distributions (>= 0, summing to 1: exactly for Fractions, within 1e-6 for floats and
    1e-3 per row for tensors); anything else would give an alpha that is not an acceptance rate."""
    if isinstance(p, torch.Tensor) and isinstance(q, torch.Tensor):
        if p.shape != q.shape:
            raise ValueError(f"p and q must have the same shape (same vocabulary), got {tuple(p.shape)} and "
                             f"{tuple(q.shape)}")
        for name, x in (("p", p), ("q", q)):
            if not x.dtype.is_floating_point or not bool(torch.isfinite(x).all()) or bool((x < 0).any()) \
                    or bool(((x.double().sum(-1) - 1).abs() > 1e-3).any()):
                raise ValueError(f"{name} must hold probability rows (finite, >= 0, each summing to 1)")
        return torch.minimum(p, q).sum(-1)
    p, q = _as_fractions(p, "p"), _as_fractions(q, "q")
    _check_same_vocab(p, q)
    for name, dist in (("p", p), ("q", q)):
        if abs(sum(dist) - 1) > Fraction(1, 10**6):
            raise ValueError(f"{name} must sum to 1 (a distribution), got {float(sum(dist)):.6g}")
    return sum(min(a, b) for a, b in zip(p, q))


@dataclass(frozen=True)
class OutputDistribution:
    """One speculative step, token by token (exact fractions):
    accepted[x] = p(x) * min(1, q(x)/p(x)) = min(p(x), q(x)), the probability x is proposed and kept;
    reject = 1 - alpha, the probability the proposal is rejected; residual[x] = norm(max(q - p, 0));
    output[x] = accepted[x] + reject * residual[x]. The claim: output == q."""

    p: tuple[Fraction, ...]
    q: tuple[Fraction, ...]
    accepted: tuple[Fraction, ...]
    reject: Fraction
    residual: tuple[Fraction, ...]
    output: tuple[Fraction, ...]

    @property
    def alpha(self) -> Fraction:
        return 1 - self.reject

    @property
    def is_exact(self) -> bool:
        return self.output == self.q


def speculative_output_distribution(p, q) -> OutputDistribution:
    """The exact distribution of the token one speculative step emits at a position where the draft
    has distribution p and the target q (any vocabulary size; p, q as ints, Fractions or strings like
    "3/5" summing to exactly 1). With two tokens A, B and p(A) > q(A) this is the lecture's proof:
    P[A] = p(A) q(A)/p(A) = q(A), P[B] = p(B) + p(A) (1 - q(A)/p(A)) = q(B)."""
    p, q = _as_fractions(p, "p"), _as_fractions(q, "q")
    _check_same_vocab(p, q)
    for name, dist in (("p", p), ("q", q)):
        if sum(dist) != 1:
            raise ValueError(f"{name} must sum to exactly 1, got {sum(dist)} (pass Fractions or strings like '1/3')")
    accepted = tuple(min(a, b) for a, b in zip(p, q))  # p(x) * min(1, q(x)/p(x)), also when p(x) = 0
    reject = 1 - sum(accepted)
    excess = [max(b - a, Fraction(0)) for a, b in zip(p, q)]
    residual = tuple(e / reject for e in excess) if reject else tuple(Fraction(0) for _ in q)
    output = tuple(a + reject * r for a, r in zip(accepted, residual))
    return OutputDistribution(p, q, accepted, reject, residual, output)


def _as_fractions(dist, name: str) -> tuple[Fraction, ...]:
    if isinstance(dist, torch.Tensor):
        dist = dist.tolist()
    if isinstance(dist, (str, bytes)) or not hasattr(dist, "__iter__"):
        raise TypeError(f"{name} must be a sequence of probabilities, got {type(dist).__name__}")
    try:
        values = tuple(Fraction(x) for x in dist)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must hold numbers (ints, Fractions, floats or strings like '1/3'): {e}") from None
    if not values:
        raise ValueError(f"{name} must not be empty")
    if any(v < 0 for v in values):
        raise ValueError(f"{name} must be non-negative, got {[str(v) for v in values]}")
    return values


def _check_same_vocab(p, q) -> None:
    if len(p) != len(q):
        raise ValueError(f"p and q must cover the same vocabulary, got {len(p)} and {len(q)} entries")
