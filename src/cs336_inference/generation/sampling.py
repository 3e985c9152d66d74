"""Turning logits into the next token: greedy, temperature, top-k and top-p (nucleus) sampling.

Top-p: Holtzman et al. 2019. `logits_to_probs` is the distribution actually sampled from, so
speculative sampling can use the *same* p and q that generation uses.
"""

from __future__ import annotations

import torch

from .. import _checks


def _check_sampling_args(temperature, top_k, top_p) -> None:
    _checks.number("temperature", temperature, 0, allowed="a finite number >= 0 (0 = greedy)")
    if top_k is not None:   # (written out, not `optional_positive_int`: one call fewer on the token path)
        _checks.integer("top_k", top_k, 1, allowed="a positive int or None")
    if top_p is not None:
        _checks.probability("top_p", top_p, allow_zero=False)


def _check_logits(logits) -> None:
    """Type, shape and values: NaN or +inf anywhere, or a row where every token is -inf, has no
    distribution to sample (argmax would silently return token 0). The value check reads one bool back
    from the device per call: sampling is where a generated token reaches the host anyway."""
    if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point:
        raise TypeError(f"logits must be a floating-point torch.Tensor of shape (..., V), got "
                        f"{logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape (..., V) with V >= 1, got {tuple(logits.shape)}")
    # `invalid_rows`, written out: one call fewer on the token path (tests/library/test_token_path.py counts them)
    if not bool(torch.isfinite(logits.amax(-1)).all()):
        raise invalid_logits_error(logits)


def invalid_logits_error(logits: torch.Tensor) -> ValueError:
    """The error for logits that `invalid_rows` refuses, saying what is wrong (reads values: an error path)."""
    what = ("NaN" if bool(torch.isnan(logits).any()) else "+inf" if bool(torch.isposinf(logits).any())
            else "a row where every logit is -inf (no token allowed)")
    return ValueError(f"logits must be finite or -inf (a forbidden token), with at least one token allowed per "
                      f"row; got {what} (a diverged model, or NaN weights?)")


def invalid_rows(logits: torch.Tensor) -> torch.Tensor:
    """(...,) bool on the device: rows with a NaN or +inf, or with every logit -inf (nothing to sample).

    One reduction finds all three: a row's max is NaN if any logit is (max propagates NaN), +inf if
    any is, -inf only if all are; elementwise isnan/isinf tests would make several passes over (..., V)."""
    return ~torch.isfinite(logits.amax(-1))


def logits_to_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                    top_p: float | None = None) -> torch.Tensor:
    """The sampling distribution (..., V) in fp32. Temperature 0 gives a one-hot on the argmax."""
    _check_logits(logits)
    _check_sampling_args(temperature, top_k, top_p)
    return _probs(logits.float(), temperature, top_k, top_p)


def _probs(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """`logits_to_probs` on checked fp32 arguments."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]      # k-th largest
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p is not None and top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs            # mass of strictly better tokens
        drop_sorted = mass_before >= top_p                              # nucleus already complete
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_next_token(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                      top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits (B, V) or (V,) -> token ids (B,) or () ; temperature 0 means greedy (argmax)."""
    _check_logits(logits)
    _check_sampling_args(temperature, top_k, top_p)
    if generator is not None:
        _checks.generator("generator", generator)
    return draw_next_token(logits, temperature, top_k, top_p, generator)


def draw_next_token(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None,
                    generator: torch.Generator | None) -> torch.Tensor:
    """`sample_next_token` on arguments already checked, reading nothing back from the device (the serving
    sampler checks a whole step's logits at once, folded into its one host copy: `invalid_rows`)."""
    if temperature == 0:
        return logits.max(-1).indices   # argmax (the first maximal index), in half argmax's time on a CPU
    return draw_from(_probs(logits.float(), temperature, top_k, top_p), generator)


def draw_from(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of probs (..., V) -> (...,) on probs' device; the draw runs on the generator's."""
    flat = probs.reshape(-1, probs.shape[-1])
    if generator is not None and generator.device != flat.device:
        flat = flat.to(generator.device)
    tokens = torch.multinomial(flat, 1, generator=generator).to(probs.device)
    return tokens.reshape(probs.shape[:-1])
