"""Autoregressive generation: `prefill` the prompt, then `decode_one_token` until done.

`generate(..., use_cache=False)` is the naive generator the lecture starts from: every step re-runs
the whole prefix through the model (O(T^2) token-forwards, O(T^3) attention FLOPs). With the cache
each step runs one token per sequence. Both produce identical tokens (a test checks).

Each token reaches the host in one copy, which also carries the check of its logits (NaN, +inf, or a
row with nothing allowed), as the serving engine's sampler does: one host sync per token, none inside
the model's step. `generate` runs attention on torch's fused kernel ("sdpa") where the model runs the
hand-written reference: one op per layer instead of a chain of small multi-threaded ones (matmul,
softmax, matmul) that stall when other work shares the cores. Same tokens up to float rounding; pass
`attention_kernel="reference"` to run (and step through) the reference.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from .. import _checks
from ..model.attention import check_attention_kernel
from ..model.kv_cache import KVCache
from .sampling import _check_sampling_args, draw_next_token, invalid_logits_error, invalid_rows


@dataclass
class GenerationResult:
    """What `generate` produced and when.

    tokens[b]: generated ids of sequence b (prompt excluded; a stop token, if hit, is included).
    token_times[t]: seconds after the call started at which step t's tokens were on the host
    (shared by the batch: one step emits one token per running sequence).
    """

    tokens: list[list[int]]
    prompt_lengths: list[int]
    token_times: list[float] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        """Time to first token (seconds): the prefill plus one sampling step."""
        return self.token_times[0] if self.token_times else None

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def total_time(self) -> float:
        return self.token_times[-1] if self.token_times else 0.0


def prefill(model, prompt_ids: torch.Tensor, cache: KVCache, pad: torch.Tensor | None = None) -> torch.Tensor:
    """Run the prompt (B, T) through the model into an empty cache; return last-position logits (B, V).

    A 1-D prompt (T,) is one sequence: logits (1, V). pad (B,): left-padding slots per prompt
    (`left_pad`); pass the same pad to every `decode_one_token`. This is an edge: the forward into an
    empty cache checks the ids (their values too), the cache and the pad.
    """
    if isinstance(cache, KVCache) and cache.length != 0:
        raise ValueError(f"prefill expects an empty cache, this one holds {cache.length} tokens")
    prompt_ids = _checks.token_ids("prompt_ids", prompt_ids)
    if prompt_ids.dim() == 1:
        prompt_ids = prompt_ids[None]
    return model(prompt_ids, cache=cache, pad=pad, last_only=True)[:, -1]


def decode_one_token(model, token_ids: torch.Tensor, cache: KVCache, pad: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step: token_ids (B,) at position cache.length -> logits (B, V) for the next token.

    The ids come from the sampler, so nothing here reads a value back from the device (no host
    sync): only their type and shape are checked; an id outside the vocabulary fails in the embedding.
    """
    if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1 or token_ids.dtype.is_floating_point:
        raise ValueError("token_ids must be a 1-D integer tensor (B,) holding one token per sequence")
    return model(token_ids[:, None], cache=cache, pad=pad)[:, -1]


def left_pad(prompts, pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """list of id lists (or a (B, T) / (T,) tensor) -> (B, T_max) left-padded ids and pad counts (B,)."""
    if isinstance(prompts, torch.Tensor):
        prompts = _checks.token_ids("prompt_ids", prompts)
        prompts = (prompts[None] if prompts.dim() == 1 else prompts).tolist()
    elif isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        prompts = [list(prompts)]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompt_ids must be a non-empty list of token-id lists or a tensor")
    for b, p in enumerate(prompts):
        _checks.token_list(f"prompt_ids[{b}]", p)
        if len(p) == 0:
            raise ValueError(f"prompt {b} is empty; every prompt needs at least one token")
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long)
    pad = torch.tensor([width - len(p) for p in prompts], dtype=torch.long)
    return ids, pad


def stop_token_set(stop_tokens, vocab_size: int) -> set[int]:
    """None, one id (int or 0-d tensor), an integer tensor of ids, or a list/tuple/set of int ids -> set."""
    if stop_tokens is None:
        return set()
    if isinstance(stop_tokens, torch.Tensor):
        if stop_tokens.dtype.is_floating_point or stop_tokens.dtype.is_complex or stop_tokens.dtype == torch.bool:
            raise TypeError(f"stop_tokens must hold integer token ids, got a tensor of dtype {stop_tokens.dtype}")
        ids = stop_tokens.reshape(-1).tolist()
    elif isinstance(stop_tokens, int) and not isinstance(stop_tokens, bool):
        ids = [stop_tokens]
    elif isinstance(stop_tokens, (list, tuple, set, frozenset)):
        ids = list(stop_tokens)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise TypeError(f"stop_tokens must be int token ids, got {type(t).__name__} {t!r} in {stop_tokens!r}")
    else:
        raise TypeError(f"stop_tokens must be None, an int, an integer tensor or a list of ints, "
                        f"got {type(stop_tokens).__name__} {stop_tokens!r}")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"stop_tokens must be in [0, vocab_size={vocab_size}), got {bad}")
    return set(ids)


@contextlib.contextmanager
def attention_kernel_for_generation(model, kernel: str | None = None):
    """Inside: `model`'s attention layers run `kernel` (None: "sdpa" where they run the reference, the
    others keep theirs); on exit each layer has its own kernel back (`TransformerLM.set_attention_kernel`
    names the kernels; layers without one, MLA's, are left alone)."""
    layers = [m for m in model.modules() if isinstance(getattr(m, "attention_kernel", None), str)]
    saved = [(layer, layer.__dict__.get("attention_kernel")) for layer in layers]   # None: the class default
    for layer in layers:
        layer.attention_kernel = kernel or ("sdpa" if layer.attention_kernel == "reference" else layer.attention_kernel)
    try:
        yield
    finally:
        for layer, own in saved:
            if own is None:
                del layer.attention_kernel
            else:
                layer.attention_kernel = own


def _next_tokens(logits: torch.Tensor, draw) -> tuple[torch.Tensor, list[int]]:
    """Draw the next ids (B,) and bring them to the host together with the logits' check, in one copy:
    the token's one host sync. Returns the ids on the device and on the host. A row with a NaN or +inf
    logit, or with none allowed, raises."""
    bad = invalid_rows(logits)                                   # (B,) on the device
    ids = draw(torch.where(bad[:, None], 0.0, logits))           # a bad row draws from a stand-in, refused below
    host = torch.cat([ids.reshape(-1), bad.long()]).tolist()     # waits for the device: the token exists now
    B = logits.shape[0]
    if any(host[-B:]):
        raise invalid_logits_error(logits)
    return ids, host[:-B]


@torch.inference_mode()
def generate(model, prompt_ids, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None, stop_tokens=None, generator: torch.Generator | None = None,
             use_cache: bool = True, pad_id: int = 0, sampler=None,
             attention_kernel: str | None = None) -> GenerationResult:
    """Generate up to `max_new_tokens` per prompt. Prompts may differ in length (left-padded).

    temperature 0 is greedy. A sequence stops at the first token in `stop_tokens` (an id, a list or a
    tensor of ids); the call ends when all have stopped or `max_new_tokens` steps have run. pad_id
    fills the left of shorter prompts (masked out, never attended to). `sampler(logits (B, V),
    temperature, top_k, top_p, generator) -> (B,)` picks each token (default `sample_next_token`'s
    draw; the autograder passes a student's sampler here). attention_kernel: what the model's attention
    layers run during the call (None: torch's fused "sdpa" where they run "reference", else their own;
    "reference" runs the hand-written one; see the module docstring). Logits that are NaN, +inf, or
    allow no token raise a ValueError.
    """
    _checks.non_negative_int("max_new_tokens", max_new_tokens)
    _check_sampling_args(temperature, top_k, top_p)
    _checks.generator("generator", generator)
    _checks.boolean("use_cache", use_cache)
    if attention_kernel is not None:
        check_attention_kernel(attention_kernel)
    if sampler is None:
        def draw(logits):   # `sample_next_token` without its per-call checks: made once above, and in `_next_tokens`
            return draw_next_token(logits, temperature, top_k, top_p, generator)
    elif callable(sampler):
        def draw(logits):
            return sampler(logits, temperature, top_k, top_p, generator)
    else:
        raise TypeError(f"sampler must be a callable (logits, temperature, top_k, top_p, generator) -> token ids, "
                        f"got {type(sampler).__name__}")
    V = model.config.vocab_size
    stop = stop_token_set(stop_tokens, V)
    _checks.integer("pad_id", pad_id, 0, V - 1, allowed=f"a token id in [0, vocab_size={V})")
    ids, pad = left_pad(prompt_ids, pad_id)
    B, P = ids.shape
    prompt_lengths = (P - pad).tolist()
    context = model.config.context_length
    if P + max_new_tokens > context:
        raise ValueError(f"longest prompt ({P} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                         f"model's context_length ({context})")
    _checks.token_ids("prompt_ids", ids, V)   # on the host, before any work (even none): no device sync
    result = GenerationResult([[] for _ in range(B)], prompt_lengths)
    if max_new_tokens == 0:
        result.finish_reasons = ["length"] * B
        return result
    pad_arg = pad.to(model.device) if max(prompt_lengths) > min(prompt_lengths) else None
    with attention_kernel_for_generation(model, attention_kernel):
        _decode_loop(model, ids.to(model.device), pad_arg, max_new_tokens, draw, stop, use_cache, result)
    return result


def _decode_loop(model, ids: torch.Tensor, pad: torch.Tensor | None, max_new_tokens: int, draw, stop: set[int],
                 use_cache: bool, result: GenerationResult) -> None:
    """`generate`'s loop on checked arguments: prefill (or the whole prefix), then one token per step,
    appending to `result` (tokens, the time each step's tokens reached the host, finish reasons)."""
    B, P = ids.shape
    done = [False] * B
    t0 = time.perf_counter()
    if use_cache:
        cache = model.new_cache(B, max_seq_len=P + max_new_tokens)
        logits = prefill(model, ids, cache, pad=pad)
    else:
        sequence = ids
        logits = model(sequence, pad=pad, last_only=True)[:, -1]

    for step in range(max_new_tokens):
        next_ids, host_ids = _next_tokens(logits, draw)
        result.token_times.append(time.perf_counter() - t0)
        for b, token in enumerate(host_ids):
            if not done[b]:
                result.tokens[b].append(token)
                done[b] = token in stop
        if all(done) or step == max_new_tokens - 1:
            break
        if use_cache:
            logits = decode_one_token(model, next_ids, cache, pad=pad)
        else:
            sequence = torch.cat([sequence, next_ids[:, None]], dim=1)
            logits = model(sequence, pad=pad, last_only=True)[:, -1]
    result.finish_reasons = ["stop" if d else "length" for d in done]
