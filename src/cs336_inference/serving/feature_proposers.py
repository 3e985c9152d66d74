"""Proposers that read the target's features: Medusa heads and an EAGLE draft inside the engine.

`Engine(model, speculative="medusa")` or `speculative="eagle"` (with `draft_model=` the heads or the
draft, or, without it, the shipped SmolLM2 ones: `generation/draft_heads.py`) drafts with the same
math as the one-sequence loop (`generation/medusa.py`, `generation/eagle.py`): one `MedusaDrafter` or
`EagleDrafter` per sequence, in `seq.proposer_state`, fed through the `Proposer` protocol's
`observe` with `TargetFeatures.last_hidden` (the last layer's output before the final norm, as
`forward(return_hidden=True)` gives it; both drafters apply the target's final norm themselves, as in
`draft_training`), and sampled drafts drawn with the sequence's own generator.

`seq.token_ids` is the only truth. A proposer drafts only when the features it holds end at the last
final position (len(token_ids) - 2: the target's prediction there is the newest token); otherwise it
proposes nothing and the step decodes one token, whose feature arrives after it. The EAGLE draft's
cache holds (h_t, x_{t+1}) for t = base .. base + true_len - 1 from the target's features (base: the
first position the engine computed for the sequence; positions taken from the prefix cache come
without features, and the draft reads from the first one it was given: RoPE only sees offsets), then
its own guesses while drafting; before each proposal it rolls them back (`EagleDrafter.rollback`).
After a preemption the recompute hands positions again: the draft forgets its cache from the first
re-handed position on and refeeds from there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _checks
from ..generation.draft_vocab import DraftHead
from ..generation.eagle import EagleDraft, EagleDrafter
from ..generation.medusa import MedusaDrafter, MedusaHeads, check_heads_match
from ..model.transformer import TransformerLM
from .sequence import Sequence


@dataclass
class TargetFeatures:
    """The target's hidden states at one sequence's newly final positions (`speculative.py`'s module docstring)."""

    positions: list[int]           # token positions in the sequence, ascending
    last_hidden: torch.Tensor      # (len(positions), D): output of the last layer, before the final norm
    #                                (what the shipped Medusa heads and EAGLE draft were trained on)
    second_to_top: torch.Tensor    # (len(positions), D): output of the layer below it (the input of the last)


@dataclass
class FeatureState:
    """One sequence's drafter, and which positions its features cover: base .. end - 1."""

    drafter: MedusaDrafter | EagleDrafter
    base: int
    end: int


class MedusaProposer:
    """Medusa heads (chain form): head k drafts the token k after the newest, from the last final feature."""

    needs_features = True

    def __init__(self, target: TransformerLM, heads: MedusaHeads):
        _checks.instance("target", target, TransformerLM)
        _checks.instance("heads", heads, MedusaHeads, "MedusaHeads (e.g. load_draft_heads(target, 'medusa-smollm2'))")
        check_heads_match(target, heads.d_model, "the Medusa heads")
        self.target, self.heads = target, heads
        self.head = DraftHead(target, heads.vocab)   # one copy of the LM-head rows for every sequence

    @torch.inference_mode()
    def propose(self, seq: Sequence, n: int) -> tuple[list[int], torch.Tensor | None]:
        state = seq.proposer_state
        if state is None or state.end != len(seq.token_ids) - 1:   # no feature of the last final position
            return [], None
        return state.drafter.propose(seq.token_ids, n, seq.request.sampling, seq.generator)

    @torch.inference_mode()
    def observe(self, seq: Sequence, features: TargetFeatures) -> None:
        if seq.proposer_state is None:
            drafter = MedusaDrafter(self.target, self.heads, self.head)
            seq.proposer_state = FeatureState(drafter, features.positions[0], 0)
        seq.proposer_state.drafter.observe(features.last_hidden)
        seq.proposer_state.end = features.positions[-1] + 1


class EagleProposer:
    """An EAGLE draft with its own KV cache per sequence, rolled back with the target's (module docstring)."""

    needs_features = True

    def __init__(self, target: TransformerLM, draft: EagleDraft, max_draft_tokens: int):
        _checks.instance("target", target, TransformerLM)
        _checks.instance("draft", draft, EagleDraft, "an EagleDraft (e.g. load_draft_heads(target, 'eagle-smollm2'))")
        check_heads_match(target, draft.d_model, "the EAGLE draft")
        if draft.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"the EAGLE draft was built for vocab_size {draft.config.vocab_size}, the target's is "
                             f"{target.config.vocab_size}; build it with eagle_config(target.config)")
        self.target, self.draft = target, draft
        self.head = DraftHead(target, draft.vocab)   # one copy of the LM-head rows for every sequence
        self.max_draft_tokens = _checks.positive_int("max_draft_tokens", max_draft_tokens)

    @torch.inference_mode()
    def propose(self, seq: Sequence, n: int) -> tuple[list[int], torch.Tensor | None]:
        state = seq.proposer_state
        if state is None or state.end != len(seq.token_ids) - 1 or not state.drafter.pending:
            return [], None
        drafter = state.drafter
        drafter.rollback(state.end - state.base)   # forget the last proposal's guesses
        return drafter.propose(seq.token_ids[state.base:], n, seq.request.sampling, seq.generator)

    @torch.inference_mode()
    def observe(self, seq: Sequence, features: TargetFeatures) -> None:
        first, state = features.positions[0], seq.proposer_state
        if state is None or not state.base <= first <= state.end:   # new, or a gap: start from these positions
            drafter = EagleDrafter(self.target, self.draft, self.head)
            drafter.start([], seq.max_len - first, max_rollback=self.max_draft_tokens + 1)
            state = seq.proposer_state = FeatureState(drafter, first, first)
        elif first < state.end:   # a recompute after preemption: positions from `first` on come again
            self._forget_from(state, first - state.base)
        state.drafter.observe(features.last_hidden)
        state.end = features.positions[-1] + 1

    @staticmethod
    def _forget_from(state: FeatureState, keep: int) -> None:
        """Keep the features of the first `keep` positions from base (in the cache or still pending); the
        cache is cut to true_len by the rollback before the next proposal."""
        drafter = state.drafter
        if keep < drafter.true_len:
            drafter.true_len, drafter.pending = keep, []
        else:
            pending = torch.cat(drafter.pending) if drafter.pending else None
            drafter.pending = [pending[:keep - drafter.true_len]] if keep > drafter.true_len else []
        state.end = state.base + keep


__all__ = ["EagleProposer", "FeatureState", "MedusaProposer", "TargetFeatures"]
