"""The latency baseline: serve a trace one sequence at a time on the model's own contiguous cache.

Requests run in arrival order, each sample of an n > 1 request after the other, plainly (`generate`)
or with speculative decoding (a draft model or prompt lookup): speculative decoding speeds up one
sequence, a latency technique. The batching `Engine` runs it too, for every running sequence at once
(`Engine(model, speculative="prompt_lookup")`, see `serving/speculative.py` and `bench
serving_speculative`); this baseline keeps the one-sequence loop for comparison. Each token gets the time its pass
finished (the tokens of one speculative pass arrive together, one chunk for ITL, as a stream
delivers them), and the clock jumps over idle gaps between arrivals like the engine's, so the
records feed the same `benchmark_metrics`.
"""

from __future__ import annotations

import time

import torch

from ..generation.generate import generate
from ..generation.speculative import SpeculativeDecoder
from ..timing import sync_device
from .request import Request, RequestRecord


def serve_one_at_a_time(target, requests: list[Request], draft=None, gamma: int = 4) -> tuple[list, dict]:
    """Serve `requests` (see the module docstring); `draft`: None, a TransformerLM or "prompt_lookup".
    Returns the RequestRecords (in the given order, engine-clock times) and the drafting statistics:
    target passes, drafts proposed and accepted, tokens per pass and the acceptance rate."""
    now, outputs, stats = 0.0, {}, {"passes": 0, "proposed": 0, "accepted": 0}
    for request in sorted(requests, key=lambda r: r.arrival_time):
        start = now = max(now, request.arrival_time)
        tokens, times, reasons = [], [], []
        for sample in range(request.sampling.n):
            out, t, reason, counts = _one_sequence(target, draft, gamma, request, sample)
            tokens.append(out)
            times.append([now + x for x in t])
            reasons.append(reason)
            now = times[-1][-1] if times[-1] else now
            for k, v in counts.items():
                stats[k] += v
        outputs[request.request_id] = RequestRecord(
            request_id=request.request_id, prompt_len=len(request.prompt), arrival_time=request.arrival_time,
            tokens=tokens, token_times=times, finish_reasons=reasons, first_scheduled_time=start, finish_time=now)
    if draft is not None and stats["passes"]:   # the first token of each sample is the prefill's
        generated = sum(len(t) for o in outputs.values() for t in o.tokens) - sum(r.sampling.n for r in requests)
        stats["tokens_per_pass"] = generated / stats["passes"]
        stats["draft_acceptance_rate"] = stats["accepted"] / stats["proposed"] if stats["proposed"] else None
    return [outputs[r.request_id] for r in requests], {"gamma": gamma if draft is not None else None, **stats}


def _one_sequence(target, draft, gamma: int, request: Request, sample: int) -> tuple[list, list, str, dict]:
    """One sample of `request`: its tokens, their times after the call started, the finish reason and
    the drafting counts (plain `generate` when draft is None; else each pass is timed)."""
    p = request.sampling
    gen = None if p.temperature == 0 or p.seed is None else torch.Generator().manual_seed(p.seed + sample)
    if draft is None:
        out = generate(target, [list(request.prompt)], request.max_new_tokens, p.temperature, p.top_k, p.top_p,
                       p.stop_token_ids or None, gen)
        return out.tokens[0], out.token_times[:len(out.tokens[0])], out.finish_reasons[0], {}
    t0 = time.perf_counter()
    decoder = SpeculativeDecoder(target, draft, [list(request.prompt)], gamma, p.temperature, request.max_new_tokens,
                                 p.top_k, p.top_p, p.stop_token_ids or None, gen)
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


__all__ = ["serve_one_at_a_time"]
