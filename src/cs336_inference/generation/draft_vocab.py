"""A draft's vocabulary: the rows of the target's LM head a trained draft may propose.

Medusa heads and an EAGLE draft turn a feature into tokens through the target's frozen LM head. On
SmolLM2 that head is 49,152 rows, and in the engine it costs about 17x the EAGLE layer itself
(docs/serving.md): most of what a drafted token costs. The drafts trained on the target's own
continuations, whose choices use a few thousand ids, and their loss only ever ranked those ids
(`draft_training._vocab_map`). So the draft's distribution *is* a softmax over those rows: computing
only them gives the trained draft exactly, at a tenth of the cost.

`DraftHead` returns full-V logits with -inf outside the draft's ids, so a proposal distribution q
is still a distribution over the whole vocabulary, zero on the ids the draft never proposes. The
accept/resample rule needs nothing more to stay exact: a token the target wants and the draft cannot
propose is simply drawn from the residual max(0, p - q) after a rejection.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import _checks
from ..model.transformer import TransformerLM


def check_vocab(name: str, ids, vocab_size: int) -> torch.Tensor:
    """ids: a 1-D integer tensor of distinct token ids in [0, vocab_size) -> them sorted, int64, on the CPU."""
    ids = _checks.token_ids(name, ids, vocab_size, dims=(1,)).cpu()
    ids = ids.sort().values
    if bool((ids[1:] == ids[:-1]).any()):
        raise ValueError(f"{name} must hold distinct token ids, got {len(ids)} ids of which "
                         f"{len(ids) - len(ids.unique())} repeat")
    return ids


def set_vocab(module: nn.Module, ids, vocab_size: int) -> None:
    """Restrict heads or a draft to the token ids it was trained to rank (None: the whole vocabulary)."""
    module.vocab = None if ids is None else check_vocab("vocab", ids, vocab_size)


class DraftHead:
    """The target's LM head as a draft sees it: z (..., D) -> logits (..., V), -inf outside `vocab`.

    The rows are copied once, when the head is built (build it again after changing the target's
    weights). A target whose lm_head is not a plain `nn.Linear` (a quantized one) computes every row
    and masks: the same distribution, without the saving."""

    def __init__(self, target: TransformerLM, vocab: torch.Tensor | None = None):
        _checks.instance("target", target, TransformerLM)
        self.target, self.vocab_size = target, target.config.vocab_size
        self.ids = None if vocab is None else check_vocab("vocab", vocab, self.vocab_size).to(target.device)
        self.rows = None
        if self.ids is not None and isinstance(target.lm_head, nn.Linear) and target.lm_head.bias is None:
            self.rows = target.lm_head.weight.detach()[self.ids]                       # (V_used, D)

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        if self.ids is None:
            return self.target.lm_head(z)
        kept = z @ self.rows.T if self.rows is not None else self.target.lm_head(z)[..., self.ids]
        out = kept.new_full((*z.shape[:-1], self.vocab_size), float("-inf"))         # (..., V)
        out[..., self.ids] = kept
        return out
