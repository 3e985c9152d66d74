"""The engine's sampler: one token per sample of every row that is due one, from the step's logits.

Greedy rows share one argmax over the batch; sampled rows draw with their own generator (sample i
of a seeded request draws from `seed + i`, so it equals `generate` with that generator). Everything
stays on the device until one copy brings the whole step's ids to the host: the one deliberate
device -> host sync of a serving step.
"""

from __future__ import annotations

import torch

from ..generation.sampling import sample_next_token
from .scheduler import ScheduledBatch


def sample(logits: torch.Tensor, batch: ScheduledBatch) -> list[list[int]]:
    """logits (B, V), row b for `batch.sequences[b]` -> per row the `batch.samples_wanted` token ids
    (a leader that just finished its prefill gets one per sample: itself, then its pending forks)."""
    rows = batch.sequences
    greedy = logits.argmax(-1)                                           # (B,)
    drawn = []
    for b, seq in enumerate(rows):
        params = seq.request.sampling
        if params.temperature == 0:
            continue
        for generator in ([seq.generator] + seq.pending_forks)[:batch.samples_wanted(seq)]:
            drawn.append(sample_next_token(logits[b], params.temperature, params.top_k, params.top_p,
                                           generator).reshape(1))
    ids = torch.cat([greedy, *drawn]).tolist()                           # the step's one host sync
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
