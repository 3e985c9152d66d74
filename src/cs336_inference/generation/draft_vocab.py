"""A draft's vocabulary: the rows of the target's LM head a trained draft may propose.

Medusa heads and an EAGLE draft turn a feature into tokens through the target's frozen LM head. On
SmolLM2 that head is 49,152 rows, many times the arithmetic of the EAGLE layer itself (docs/serving.md):
most of what a drafted token costs. The drafts trained on the target's own continuations, whose
choices use a few thousand ids, and their loss only ever ranked those ids (`draft_training._vocab_map`).
So the trained draft's distribution is a softmax over those rows: computing only them gives it exactly,
for about a tenth of the head.

`DraftHead` returns full-V logits with -inf outside the draft's ids, so a proposal distribution q
is still a distribution over the whole vocabulary, zero on the ids the draft never proposes. The
accept/resample rule needs nothing more to stay exact: a token the target wants and the draft cannot
propose is simply drawn from the residual max(0, p - q) after a rejection.
"""

from __future__ import annotations

import warnings

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


def _row_reader(lm_head: nn.Module):
    """(dtype, ids (V_used,)) -> the head's rows (V_used, D) with lm_head(z)[..., ids] = z @ rows.T, for a
    plain head or one that offers `weight_rows` (a quantized head: the fast path's int8 codes, dequantized);
    None for a head with a bias or of another kind."""
    if getattr(lm_head, "bias", None) is not None:
        return None
    if isinstance(lm_head, nn.Linear):
        return lambda dtype, ids: lm_head.weight.detach()[ids].to(dtype)
    if hasattr(lm_head, "weight_rows"):
        return lambda dtype, ids: lm_head.weight_rows(ids, dtype)
    return None


class DraftHead:
    """The target's LM head as a draft sees it: z (..., D) -> logits (..., V), -inf outside `vocab`.

    The rows (dequantized, for a quantized head) are read once, at the first call in each dtype (build
    the head again after changing the target's weights). A head whose rows cannot be read this way
    computes every logit and masks: the same distribution, without the saving (announced once)."""

    def __init__(self, target: TransformerLM, vocab: torch.Tensor | None = None):
        _checks.instance("target", target, TransformerLM)
        self.target, self.vocab_size = target, target.config.vocab_size
        self.ids = None if vocab is None else check_vocab("vocab", vocab, self.vocab_size).to(target.device)
        self._read_rows = None if self.ids is None else _row_reader(target.lm_head)
        self._rows = None                                                               # (V_used, D)
        if self.ids is not None and self._read_rows is None:
            warnings.warn(f"the draft's LM head ({type(target.lm_head).__name__}) cannot give its rows for the "
                          f"{len(self.ids)} ids the draft ranks: every draft token computes all {self.vocab_size} "
                          "logits and masks the rest (the same distribution, without the saving)", stacklevel=2)

    @property
    def reads_rows(self) -> bool:
        """Whether a call multiplies by the kept rows only (the saving), not by the whole head."""
        return self._read_rows is not None

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        if self.ids is None:
            return self.target.lm_head(z)
        if self._read_rows is None:
            kept = self.target.lm_head(z)[..., self.ids]
        else:
            if self._rows is None or self._rows.dtype != z.dtype:
                with torch.no_grad():
                    self._rows = self._read_rows(z.dtype, self.ids)
            kept = z @ self._rows.T                                                     # (..., V_used)
        out = kept.new_full((*z.shape[:-1], self.vocab_size), float("-inf"))         # (..., V)
        out[..., self.ids] = kept
        return out


def draft_head(target: TransformerLM, module: nn.Module, head: DraftHead | None) -> DraftHead:
    """The LM head a drafter reads for heads or a draft `module`: `head` when given (one shared by every
    sequence's drafter in the engine: its rows are read once), else a new one over `module.vocab`."""
    if head is None:
        return DraftHead(target, module.vocab)
    _checks.instance("head", head, DraftHead)
    if head.target is not target:
        raise ValueError("head was built for another target model: build it with DraftHead(target, module.vocab)")
    return head
