"""Speculative decoding: a cheap drafter proposes gamma tokens, the target checks them in one pass.

Leviathan, Kalman & Matias 2023 (arXiv:2211.17192); Chen et al. 2023 (arXiv:2302.01318).
Checking is cheaper than generating: verifying gamma + 1 positions is one forward of gamma + 1
tokens (like a small prefill), which costs about as much as one decode step when decode is
memory-bound. Each pass emits the accepted drafts plus one token from the target, so at least one
token per target forward, and the accept/resample rule (`speculative_accept`) makes the output an
exact sample from the target.

One pass, with the sequence `seq` (N tokens) and the target cache holding seq[:N-1]:
  1. the drafter proposes x_1..x_g (g <= gamma) and their draft distributions p_1..p_g;
  2. the target runs [seq[-1], x_1..x_g] at positions N-1..N-1+g -> q_1..q_{g+1};
  3. the rule keeps x_1..x_k and emits one more token y;
  4. both caches roll back (`truncate`) to the N + k positions now final: the rejected drafts'
     keys and values are simply forgotten.
A drafter that reads the target's hidden states (Medusa heads, an EAGLE draft: it has `observe`) is
handed the target's features of the positions that became final: the prompt's after the prefill,
and the k + 1 positions seq[-1], x_1..x_k after each pass (`forward(..., return_hidden=True)`).

A pass whose drafter proposes nothing (prompt lookup finds no earlier copy) is a plain decode step;
`decode_step`, e.g. a compiled one (`compile_decode`), runs those passes as plain decoding would.
`verify_step`, e.g. `compile_verify(target)`, runs the passes with drafts (the target's forward
signature, compiled for any number of tokens); without it they run the eager forward.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from .. import _checks
from ..model.transformer import TransformerLM
from ..timing import sync_device
from .drafters import Drafter, ModelDrafter, SamplingParams
from .generate import left_pad, prefill, stop_token_set
from .prompt_lookup import PromptLookupDrafter
from .sampling import sample_next_token
from .speculative_rule import accept_unchecked, greedy_accept


@dataclass
class SpeculativeResult:
    """Tokens of one sequence (prompt excluded) and what it took to make them.

    proposed[j], accepted[j]: draft tokens offered and kept in target pass j (the first generated
    token comes from the prefill, not from a pass). Times are wall-clock seconds, device-synchronised.
    """

    tokens: list[int]
    prompt_length: int
    gamma: int
    finish_reason: str = "length"
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    target_forwards: int = 0   # verification passes (prefill excluded)
    draft_forwards: int = 0    # draft-model decode forwards (prefill excluded; 0 for prompt lookup)
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    total_time_s: float = 0.0

    @property
    def num_generated(self) -> int:
        return len(self.tokens)

    @property
    def mean_tokens_per_pass(self) -> float:
        """Tokens emitted per target verification pass (accepted drafts + the target's own token)."""
        passes = len(self.accepted)
        return sum(k + 1 for k in self.accepted) / passes if passes else 0.0

    @property
    def acceptance_by_position(self) -> list[float | None]:
        """Entry i: of the passes whose draft token i+1 was examined, the fraction that accepted it
        (None where none was). Constant under the i.i.d. model behind `expected_tokens_per_pass`."""
        rates = []
        for i in range(self.gamma):
            tried = sum(1 for g, k in zip(self.proposed, self.accepted) if g > i and k >= i)
            kept = sum(1 for k in self.accepted if k > i)
            rates.append(kept / tried if tried else None)
        return rates

    @property
    def alpha(self) -> float | None:
        """Per-token acceptance rate: accepted / examined over all passes (each pass examines its
        accepted drafts plus the rejected one, if any). The estimate of alpha the theory uses."""
        examined = sum(k + (1 if k < g else 0) for g, k in zip(self.proposed, self.accepted))
        return sum(self.accepted) / examined if examined else None

    @property
    def draft_acceptance_rate(self) -> float | None:
        """Fraction of all proposed draft tokens that were accepted (drafts after a rejection count as lost)."""
        total = sum(self.proposed)
        return sum(self.accepted) / total if total else None

    @property
    def decode_time_s(self) -> float:
        return self.total_time_s - self.prefill_time_s


def as_drafter(draft) -> Drafter:
    """A `TransformerLM` becomes a `ModelDrafter`; "prompt_lookup" a `PromptLookupDrafter`; a
    drafter object is used as is."""
    if isinstance(draft, TransformerLM):
        return ModelDrafter(draft)
    if isinstance(draft, str) and draft == "prompt_lookup":
        return PromptLookupDrafter()
    if isinstance(draft, Drafter):
        return draft
    raise TypeError(f"draft must be a TransformerLM, 'prompt_lookup' or a Drafter (start/propose/rollback), "
                    f"got {type(draft).__name__}")


def _check_args(target, drafter, gamma, max_new_tokens, generator) -> None:
    _checks.instance("target", target, TransformerLM)
    _checks.positive_int("gamma", gamma)
    _checks.non_negative_int("max_new_tokens", max_new_tokens)
    _checks.generator("generator", generator)
    if hasattr(drafter, "observe") and getattr(drafter, "target", target) is not target:
        raise ValueError("the drafter reads another model's features: build it on this target "
                         "(MedusaDrafter(target, heads), EagleDrafter(target, draft), load_drafter(target, ...))")
    draft_model = getattr(drafter, "model", None)   # a ModelDrafter's, or the one behind a LookupThenDraft
    if isinstance(draft_model, TransformerLM):
        d, t = draft_model.config, target.config
        if d.vocab_size != t.vocab_size:
            raise ValueError(f"draft and target vocabularies differ: draft vocab_size {d.vocab_size}, target "
                             f"{t.vocab_size}; speculative sampling needs a shared vocabulary (same tokenizer)")
        if draft_model.device != target.device:
            raise ValueError(f"draft is on {draft_model.device} but target on {target.device}; move both "
                             "to one device")


def _prompt_list(prompt_ids) -> list[int]:
    ids, _ = left_pad(prompt_ids)
    if ids.shape[0] != 1:
        raise ValueError(f"speculative_generate decodes one sequence; got a batch of {ids.shape[0]} prompts")
    return ids[0].tolist()


class _Clock:
    """Accumulates device-synchronised wall time into named buckets."""

    def __init__(self, device: torch.device):
        self.device, self.totals = device, {}

    @contextlib.contextmanager
    def measure(self, bucket: str):
        sync_device(self.device)
        t0 = time.perf_counter()
        yield
        sync_device(self.device)
        self.totals[bucket] = self.totals.get(bucket, 0.0) + time.perf_counter() - t0


class SpeculativeDecoder:
    """The speculative loop one pass at a time (for tests, notebooks and the lecture; the caches and
    the sequence are inspectable between passes). `speculative_generate` runs it to the end.

    Construction prefills the target (and the drafter) and samples the first token from the target.
    Invariant between passes: `target_cache` holds sequence[:-1]; the drafter's cache a prefix of it.
    """

    @torch.inference_mode()
    def __init__(self, target: TransformerLM, draft, prompt_ids, gamma: int = 4, temperature: float = 0.0,
                 max_new_tokens: int = 64, top_k: int | None = None, top_p: float | None = None,
                 stop_tokens=None, generator: torch.Generator | None = None, decode_step=None, verify_step=None):
        self.drafter = as_drafter(draft)
        _check_args(target, self.drafter, gamma, max_new_tokens, generator)
        if decode_step is not None and not callable(decode_step):
            raise TypeError(f"decode_step must be a callable (token_ids (1,), cache) -> logits (1, V) or None, "
                            f"got {type(decode_step).__name__}")
        if verify_step is not None and not callable(verify_step):
            raise TypeError(f"verify_step must be a callable with the target's forward signature (token_ids (1, T), "
                            f"cache=, return_hidden=), e.g. compile_verify(target), or None, got "
                            f"{type(verify_step).__name__}")
        self.sampling = SamplingParams(temperature, top_k, top_p)
        self.target, self.gamma, self.max_new_tokens, self.generator = target, gamma, max_new_tokens, generator
        self.decode_step = decode_step
        self.verify = verify_step or target   # the forward that checks a pass's drafts
        self.stop = stop_token_set(stop_tokens, target.config.vocab_size)   # as `generate` accepts them
        prompt = _prompt_list(prompt_ids)
        P = len(prompt)
        for who, model in (("target", target), ("draft", getattr(self.drafter, "model", None))):
            if model is not None and P + max_new_tokens > model.config.context_length:
                raise ValueError(f"prompt ({P} tokens) + max_new_tokens ({max_new_tokens}) exceeds the {who}'s "
                                 f"context_length ({model.config.context_length})")
        self.device = target.device
        self.reads_features = hasattr(self.drafter, "observe")   # Medusa / EAGLE read the target's hidden states
        prompt_tensor = _checks.token_ids("prompt_ids", torch.tensor([prompt]), target.config.vocab_size)
        prompt_tensor = prompt_tensor.to(self.device)
        self.result = SpeculativeResult([], P, gamma)
        self.sequence = list(prompt)
        self.target_cache = None
        self.finished = max_new_tokens == 0
        self._clock = _Clock(self.device)
        self._t0 = time.perf_counter()
        if self.finished:
            return
        with self._clock.measure("prefill"):
            # a pass may be rolled back by up to gamma + 1 positions (sliding-window rings keep spare slots)
            self.target_cache = target.new_cache(1, P + max_new_tokens, max_rollback=gamma + 1)
            self.drafter.start(prompt, P + max_new_tokens, max_rollback=gamma + 1)
            if self.reads_features:   # the prompt's features go to the drafter
                logits, hidden = target(prompt_tensor, cache=self.target_cache, last_only=True, return_hidden=True)
                logits = logits[0, -1]
                self.drafter.observe(hidden[0])                                                # (P, D)
            else:
                logits = prefill(target, prompt_tensor, self.target_cache)[0]                   # (V,)
            first = int(sample_next_token(logits, temperature, top_k, top_p, generator))
        self._emit([first])

    def _emit(self, new: list[int]) -> None:
        self.sequence += new
        for t in new:
            self.result.tokens.append(t)
            if t in self.stop:
                self.finished, self.result.finish_reason = True, "stop"
                break
        if len(self.result.tokens) >= self.max_new_tokens:
            self.finished = True

    @torch.inference_mode()
    def step(self) -> list[int]:
        """One draft-verify-rollback pass; returns the tokens it emitted (1 to gamma + 1)."""
        if self.finished:
            raise RuntimeError("generation has finished (max_new_tokens reached or a stop token emitted)")
        sequence, cache, clock = self.sequence, self.target_cache, self._clock
        n = min(self.gamma, self.max_new_tokens - len(self.result.tokens) - 1)  # stay within the caches' room
        with clock.measure("draft"):
            drafts, p_draft = self.drafter.propose(sequence, n, self.sampling, self.generator)
        with clock.measure("target"):
            ids = torch.tensor([sequence[-1:] + drafts], device=self.device)                   # (1, g+1)
            if not drafts and self.decode_step is not None and not self.reads_features:
                logits = self.decode_step(ids[0], cache)                                       # (1, V)
            elif self.reads_features:
                logits, hidden = self.verify(ids, cache=cache, return_hidden=True)
                logits, hidden = logits[0], hidden[0]                                          # (g+1, V), (g+1, D)
            else:
                logits = self.verify(ids, cache=cache)[0]                                      # (g+1, V)
        with clock.measure("accept"):
            if self.sampling.greedy:
                k, token = greedy_accept(drafts, logits.argmax(-1).tolist())
            else:
                q = self.sampling.probs(logits)                                                # (g+1, V)
                draft_ids = torch.tensor(drafts, dtype=torch.long, device=self.device)         # (g,)
                if p_draft is None:  # deterministic drafts (prompt lookup): p is one-hot
                    p_draft = torch.nn.functional.one_hot(draft_ids, q.shape[-1]).to(q.dtype)
                k, token = accept_unchecked(p_draft, q, draft_ids, self.generator)
            new = drafts[:k] + [token]
            final = len(sequence) + k  # positions now final, and what the next pass builds on
            if cache.length > final:   # the rejected drafts' keys and values are forgotten
                cache.truncate(final)
            self.drafter.rollback(final)
            if self.reads_features:
                self.drafter.observe(hidden[:k + 1])   # the features of the positions now final
        self.result.proposed.append(len(drafts))
        self.result.accepted.append(k)
        self._emit(new)
        return new

    def finish(self) -> SpeculativeResult:
        """The result so far, with forward counts and the time split filled in."""
        r, totals = self.result, self._clock.totals
        r.target_forwards = len(r.accepted)
        r.draft_forwards = self.drafter.forwards
        r.prefill_time_s = totals.get("prefill", 0.0)
        r.draft_time_s = totals.get("draft", 0.0)
        r.target_time_s = totals.get("target", 0.0)
        r.total_time_s = time.perf_counter() - self._t0
        return r


def speculative_generate(target: TransformerLM, draft, prompt_ids, gamma: int = 4, temperature: float = 0.0,
                         max_new_tokens: int = 64, top_k: int | None = None, top_p: float | None = None,
                         stop_tokens=None, generator: torch.Generator | None = None,
                         decode_step=None, verify_step=None) -> SpeculativeResult:
    """Generate up to `max_new_tokens` tokens after one prompt, drafting `gamma` tokens per target pass.

    draft: a `TransformerLM` sharing the target's vocabulary, "prompt_lookup", or a `Drafter`.
    temperature / top_k / top_p apply to both models (0 = greedy: the output equals the target's
    greedy output); otherwise the output is distributed exactly as `generate(target, ...)` samples.
    decode_step(token_ids (1,), cache) -> logits (1, V): runs the passes without drafts; verify_step (the
    target's forward signature, e.g. `compile_verify(target)`): the passes with drafts (see the module
    docstring; None: the eager forward).
    Returns the tokens with acceptance statistics, forward counts and the time split.
    """
    decoder = SpeculativeDecoder(target, draft, prompt_ids, gamma, temperature, max_new_tokens, top_k, top_p,
                                 stop_tokens, generator, decode_step, verify_step)
    while not decoder.finished:
        decoder.step()
    return decoder.finish()
