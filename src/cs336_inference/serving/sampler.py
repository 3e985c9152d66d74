"""The engine's sampler: one token per sample of every row that is due one, from the step's logits.

Greedy rows share one argmax over the batch; sampled rows draw with their own generator (sample i
of a seeded request draws from `seed + i`, so it equals `generate` with that generator). Everything
stays on the device until one copy brings the whole step's ids to the host: the one deliberate
device -> host sync of a serving step. The logits' check (NaN, +inf, or a row with nothing allowed)
rides on that same copy, so sampled rows cost no sync of their own.
"""

from __future__ import annotations

import torch

from ..generation.sampling import draw_next_token, invalid_rows
from .scheduler import ScheduledBatch


def sample(logits: torch.Tensor, batch: ScheduledBatch) -> list[list[int]]:
    """logits (B, V), row b for `batch.sequences[b]` -> per row the `batch.samples_wanted` token ids
    (a leader that just finished its prefill gets one per sample: itself, then its pending forks)."""
    rows = batch.sequences
    bad = invalid_rows(logits)                                           # (B,) on the device
    greedy = logits.argmax(-1)                                           # (B,)
    safe = torch.where(bad[:, None], 0.0, logits)    # a bad row draws from a valid stand-in, then is refused below
    drawn = []
    for b, seq in enumerate(rows):
        params = seq.request.sampling
        if params.temperature == 0:
            continue
        for generator in ([seq.generator] + seq.pending_forks)[:batch.samples_wanted(seq)]:
            drawn.append(draw_next_token(safe[b], params.temperature, params.top_k, params.top_p,
                                         generator).reshape(1))
    ids = torch.cat([greedy, *drawn, bad.long()]).tolist()               # the step's one host sync
    ids, bad_rows = ids[:-len(rows)], [b for b, flag in enumerate(ids[-len(rows):]) if flag]
    if bad_rows:
        names = sorted({rows[b].request.request_id for b in bad_rows}, key=str)
        raise ValueError(f"the model's logits are NaN or +inf (or allow no token) for requests {names}: a diverged "
                         f"model, or NaN weights?")
    out, next_drawn = [], len(rows)
    for b, seq in enumerate(rows):
        n = batch.samples_wanted(seq)
        if seq.request.sampling.temperature == 0:
            out.append([ids[b]] * n)
        else:
            out.append(ids[next_drawn:next_drawn + n])
            next_drawn += n
    return out


__all__ = ["sample"]
