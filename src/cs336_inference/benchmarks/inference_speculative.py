"""The speculative axis of `bench inference`: one request at a time, with and without speculative decoding.

Speculative decoding (`generation.speculative`) decodes one sequence: the drafter proposes `gamma`
tokens and the target verifies them in one pass. It is a latency technique for a single user, so this
axis serves the chat operating point one request at a time (sparse arrivals: no queueing) and compares,
on the same single-sequence path (the model's contiguous KV cache, batch 1):
  off            plain decoding (`generate`): one target forward per token;
  prompt_lookup  drafts copied from the context (no draft model);
  draft          the shipped draft model (the target pruned and distilled; toy target only).
Every token gets the time its pass finished, so the tokens of one pass arrive together (one chunk for
ITL, as a stream would deliver them); the clock jumps over idle gaps like the engine's.
"""

from __future__ import annotations

import time

import torch

from ..generation.generate import generate
from ..generation.speculative import SpeculativeDecoder
from ..serving.request import Request, RequestRecord
from ..timing import sync_device

GAMMA = 4   # drafts per target pass: near the best measured by `bench speculative` on both models


def _generator(request: Request, sample: int) -> torch.Generator | None:
    p = request.sampling
    if p.temperature == 0 or p.seed is None:
        return None
    return torch.Generator().manual_seed(p.seed + sample)


def _plain(target, request: Request, sample: int) -> tuple[list[int], list[float], str, dict]:
    """Plain decoding of one sample: tokens, their times after the call started, finish reason."""
    p = request.sampling
    out = generate(target, [list(request.prompt)], request.max_new_tokens, p.temperature, p.top_k, p.top_p,
                   p.stop_token_ids or None, _generator(request, sample))
    tokens = out.tokens[0]
    return tokens, out.token_times[:len(tokens)], out.finish_reasons[0], {}


def _speculative(target, draft, gamma: int, request: Request, sample: int) -> tuple[list[int], list[float], str, dict]:
    """Speculative decoding of one sample, timing each pass (its tokens share the pass's end time)."""
    p = request.sampling
    t0 = time.perf_counter()
    decoder = SpeculativeDecoder(target, draft, [list(request.prompt)], gamma, p.temperature, request.max_new_tokens,
                                 p.top_k, p.top_p, p.stop_token_ids or None, _generator(request, sample))
    sync_device(target.device)
    times = [time.perf_counter() - t0] * len(decoder.result.tokens)       # the first token, from the prefill
    while not decoder.finished:
        before = len(decoder.result.tokens)
        decoder.step()
        sync_device(target.device)
        times += [time.perf_counter() - t0] * (len(decoder.result.tokens) - before)
    r = decoder.finish()
    return r.tokens, times, r.finish_reason, {"passes": len(r.accepted), "proposed": sum(r.proposed),
                                              "accepted": sum(r.accepted)}


def serve_one_at_a_time(target, requests: list[Request], draft=None, gamma: int = GAMMA) -> tuple[list, dict]:
    """Serve `requests` in arrival order, one sequence at a time (the samples of an n > 1 request one
    after the other), plainly (`draft=None`) or speculatively (`draft`: a TransformerLM or
    "prompt_lookup"). Returns the RequestRecords (in the given order, engine-clock times) and the
    drafting statistics: target passes, drafts proposed and accepted, tokens per pass."""
    now, outputs, stats = 0.0, {}, {"passes": 0, "proposed": 0, "accepted": 0}
    for request in sorted(requests, key=lambda r: r.arrival_time):
        start = now = max(now, request.arrival_time)
        tokens, times, reasons = [], [], []
        for sample in range(request.sampling.n):
            if draft is None:
                out, t, reason, counts = _plain(target, request, sample)
            else:
                out, t, reason, counts = _speculative(target, draft, gamma, request, sample)
            tokens.append(out)
            times.append([now + x for x in t])
            reasons.append(reason)
            now = times[-1][-1] if times[-1] else now
            for k, v in counts.items():
                stats[k] += v
        outputs[request.request_id] = RequestRecord(
            request_id=request.request_id, prompt_len=len(request.prompt), arrival_time=request.arrival_time,
            tokens=tokens, token_times=times, finish_reasons=reasons, first_scheduled_time=start, finish_time=now)
    if draft is not None and stats["passes"]:
        generated = sum(len(t) for o in outputs.values() for t in o.tokens) - sum(r.sampling.n for r in requests)
        stats["tokens_per_pass"] = generated / stats["passes"]   # the first token of each sample is the prefill's
        stats["draft_acceptance_rate"] = stats["accepted"] / stats["proposed"] if stats["proposed"] else None
    return [outputs[r.request_id] for r in requests], {"gamma": gamma if draft is not None else None, **stats}


__all__ = ["GAMMA", "serve_one_at_a_time"]
