"""What speculative decoding costs on this machine: the c and v that `expected_speedup` takes, measured.

The theory (`speculative_theory`) predicts the speed-up from alpha and two costs, in units of one
plain decode step of the target (forward + sampling):
  c     one draft token (the draft model's forward + sampling), or one prompt lookup per pass;
  v(g)  the target's verification pass over g + 1 tokens, the accept rule included.
Leviathan et al. assume a memory-bound target, v = 1. On a CPU, or with a small target that fits in
the caches, a pass over g + 1 tokens costs more than one step, so measure v instead of assuming it.

Each cost is timed in cycles that also time one plain step, and kept as the median of the
per-cycle ratios: a ratio taken within a few milliseconds is robust to the load drifting on a
shared machine. A model drafter is timed in the loop's rhythm (gamma draft steps, then the
verification): two models taking turns evict each other's weights from a CPU's private caches, so
both cost more than timed alone. Times come on two clocks: "wall" and "cpu" (this process's CPU
time: with one thread, the time the work ran, however busy the machine).
"""

from __future__ import annotations

import statistics
import time

import torch

from .. import _checks
from ..timing import sync_device
from .prompt_lookup import prompt_lookup_propose
from .sampling import sample_next_token
from .sampling_params import SamplingParams
from .speculative_rule import accept_unchecked, greedy_accept
from .speculative_theory import expected_speedup, expected_tokens_per_pass

CLOCKS = ("wall", "cpu")


def timed(fn, device: torch.device) -> tuple[object, float, float]:
    """(fn(), wall seconds, CPU seconds of this process), device-synchronised."""
    sync_device(device)
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    sync_device(device)
    return out, time.perf_counter() - wall, time.process_time() - cpu


class _StepTimer:
    """A model with its cache prefilled to `ids`: `step(T, then)` times one forward over T new tokens
    followed by `then(logits (T, V))`, then rolls the cache back, so every call sees the same context."""

    def __init__(self, model, ids: torch.Tensor, gen: torch.Generator, room: int):
        self.model, self.context, self.gen = model, ids.shape[1], gen
        self.cache = model.new_cache(1, self.context + room)
        model(ids, cache=self.cache)

    def step(self, num_tokens: int, then) -> tuple[float, float]:
        model = self.model
        new = torch.randint(0, model.config.vocab_size, (1, num_tokens), device=model.device, generator=self.gen)

        def run():
            then(model(new, cache=self.cache)[0])   # (num_tokens, V)
            self.cache.truncate(self.context)
        return timed(run, model.device)[1:]


def _median_ratios(cycles: list[dict]) -> dict:
    """{name: {clock: median over cycles of name's seconds / the plain step's ("token") in that cycle}}."""
    return {name: {k: statistics.median(c[name][i] / c["token"][i] for c in cycles) for i, k in enumerate(CLOCKS)}
            for name in cycles[0] if name != "token"}


@torch.inference_mode()
def measure_costs(target, drafters: dict, context_ids: list[int], gammas, temperature: float = 0.0,
                  repeats: int = 30) -> dict:
    """Costs at a context of `context_ids`, in plain decode steps of `target` (see the module docstring):
      token           one plain step itself, {clock: seconds};
      verify[g]       the pass over g + 1 tokens + the accept rule, for g = 0 .. max(gammas);
      NAME[gamma]     a model drafter: {"draft": per draft token, "verify": per pass, in the loop's rhythm};
                      "prompt_lookup": one search, per pass.
    `drafters`: {name: a TransformerLM sharing the target's vocabulary, or "prompt_lookup"}."""
    if not isinstance(drafters, dict) or not gammas or not all(_checks._is_int(g) and g >= 1 for g in gammas):
        raise ValueError(f"drafters must be a dict and gammas a non-empty sequence of ints >= 1, got "
                         f"{type(drafters).__name__} and {gammas!r}")
    _checks.positive_int("repeats", repeats)
    device, V = target.device, target.config.vocab_size
    sampling, gen = SamplingParams(temperature), torch.Generator(device=device).manual_seed(0)
    seq, room = list(context_ids), max(gammas) + 2
    ids = torch.tensor([seq], device=device)

    def sample(logits):   # what `generate` and the model drafter do with each token's logits
        return sample_next_token(logits[-1], temperature, generator=gen).tolist()

    def accept(g):
        drafts = torch.randint(0, V, (g,), device=device, generator=gen)
        p = torch.softmax(torch.randn(g, V, device=device, generator=gen), -1)

        def rule(logits):
            if sampling.greedy:
                return greedy_accept(drafts.tolist(), logits.argmax(-1).tolist())
            return accept_unchecked(p, sampling.probs(logits), drafts, gen)
        return rule

    verifier = _StepTimer(target, ids, gen, room)

    def cycles(one_cycle) -> list[dict]:
        one_cycle()   # warm-up
        return [one_cycle() | {"token": verifier.step(1, sample)} for _ in range(repeats)]

    def draft_cycle(drafter, gamma):
        def one_cycle():
            steps = [drafter.step(1, sample) for _ in range(gamma)]
            return {"draft": tuple(sum(t[k] for t in steps) / gamma for k in (0, 1)),
                    "verify": verifier.step(gamma + 1, accept(gamma))}
        return one_cycle

    def lookup_cycle(g):
        return lambda: {"lookup": timed(lambda: prompt_lookup_propose(seq, g), device)[1:]}

    tokens, verify = [], {}
    for g in range(max(gammas) + 1):
        runs = cycles(lambda g=g: {"verify": verifier.step(g + 1, accept(g))})
        verify[g] = _median_ratios(runs)["verify"]
        tokens += [c["token"] for c in runs]
    costs = {"token": {k: statistics.median(t[i] for t in tokens) for i, k in enumerate(CLOCKS)}, "verify": verify}
    for name, draft in drafters.items():
        if draft == "prompt_lookup":
            costs[name] = {g: _median_ratios(cycles(lookup_cycle(g)))["lookup"] for g in gammas}
        else:
            drafter = _StepTimer(draft, ids, gen, room)
            costs[name] = {g: _median_ratios(cycles(draft_cycle(drafter, g))) for g in gammas}
    return costs


def predicted_speedup(costs: dict, drafter: str, alpha: float, gamma: int, proposed: list[int],
                      clock: str = "wall") -> dict:
    """The speed-up the theory predicts from a measured alpha and `measure_costs`' costs: mean over the
    passes j of E[tokens | alpha, g_j] / mean of (g_j c + v(g_j)), g_j the drafts pass j proposed (a
    pass near the end proposes fewer than gamma); `paper_speedup` is Leviathan et al.'s
    E[tokens | alpha, gamma] / (gamma c + 1). Returns both, with c, v(gamma) and the tokens per pass."""
    verify = {g: v[clock] for g, v in costs["verify"].items()}
    tokens = statistics.fmean(expected_tokens_per_pass(alpha, g) for g in proposed)
    measured = costs[drafter][gamma]
    if "draft" in measured:                  # a model drafter, timed in the loop's rhythm
        c, verify[gamma] = measured["draft"][clock], measured["verify"][clock]
        cost = statistics.fmean(g * c + verify[g] for g in proposed)
    else:                                    # prompt lookup: one search per pass
        cost = statistics.fmean(measured[clock] + verify[g] for g in proposed)
        c = measured[clock] / gamma          # per drafted token, for the paper's formula
    return dict(predicted_speedup=tokens / cost, paper_speedup=expected_speedup(alpha, gamma, c), cost_ratio=c,
                verify_cost=verify[gamma], predicted_tokens_per_pass=tokens)


__all__ = ["measure_costs", "predicted_speedup", "timed"]
