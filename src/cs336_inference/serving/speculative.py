"""Speculative decoding inside the engine: drafts for every running sequence, verified in one forward.

`Engine(model, speculative="prompt_lookup", num_speculative_tokens=4)` (or `speculative="draft",
draft_model=...`; `"medusa"` / `"eagle"` with draft_model= the heads or the shipped SmolLM2 ones,
`feature_proposers.py`; or `proposer=` any `Proposer`) runs each step as the plain engine does, with four
changes (the plain path, `speculative=None`, is untouched):

- schedule (`SpeculativeScheduler`): for every running sequence that decodes, the proposer offers up
  to k tokens (k = num_speculative_tokens; fewer when max_tokens, the step's token budget or the free
  blocks leave less room; none while more than speculative_disable_by_batch_size sequences run), and
  the scheduler reserves 1 + k KV slots: the last sampled token and its drafts. Blocks that drafts
  fill get no prefix-cache name (their tokens are not final yet).
- run (`ModelRunner`): a decode row brings its last token and its drafts (query length 1 + k) beside
  the prefills' chunks, all in the same ragged forward; logits come back for each prefill's last token
  and for all 1 + k positions of each decode: the target's q_1 .. q_{k+1}.
- sample (`speculative_sample`): per row the exact rule of `generation/speculative_rule.py`. A greedy
  row keeps its drafts while each equals the target's argmax (one host copy serves every greedy row);
  a sampled row accepts x_i with probability min(1, q_i(x_i) / p_i(x_i)) and resamples from the
  residual norm(max(q_i - p_i, 0)) at the first rejection, or draws a bonus token from q_{k+1}.
  A row emits its accepted drafts and one more token (1 .. k + 1 tokens). (A sampled row with drafts
  reads its uniforms and its token back by itself: host syncs the plain engine does not have.)
- postprocess (`SpeculativeScheduler.postprocess`): append the emitted tokens one by one, stopping at
  a stop token or max_tokens exactly where one-token decoding would; advance num_computed_tokens by
  1 + accepted; `KVCacheManager.truncate` the table to it (the rejected drafts' blocks go back to the
  pool: they were reserved this step, so a block shared with the prefix cache or a sibling is never
  among them), and name the blocks the accepted tokens filled.

The tokens of one step arrive together (one chunk: their inter-token latencies after the first are 0,
as a stream delivers them and as `one_at_a_time` records its speculative passes).

The proposer protocol (`Proposer`): what the engine needs from whatever drafts.
    propose(seq, n) -> (tokens, probs)  up to n tokens that may follow seq.token_ids, and the
                                        distribution each was drawn from ((len(tokens), V) on the
                                        model's device, or None: deterministic, one-hot drafts)
    needs_features: bool                True for a proposer that reads the target's hidden states
                                        (Medusa heads, an EAGLE draft): then after every step the
                                        engine calls
    observe(seq, features)              with `TargetFeatures`: the target's last hidden state (the
                                        final layer's output, before the final norm) and its
                                        second-to-top hidden state (the input of the last layer) at
                                        the positions of this step's rows that are now final (a
                                        decode's last token and accepted drafts; every token of a
                                        prefill chunk, chunk by chunk, from the first position the
                                        step computed: a prefix-cache hit's positions come without
                                        features), so a head can draft from the newest one and an
                                        EAGLE draft can feed its own cache from the first one.
A proposer keeps its per-sequence state in `seq.proposer_state` (dropped with the sequence; forked
siblings start without one) and must tolerate being asked again after a rollback or a preemption:
`seq.token_ids` is the only truth. A draft model rolls its own cache back to it; a feature proposer
drafts only when the features it holds reach the last final position (len(seq.token_ids) - 2), and
after a preemption the recompute hands positions it already had again: it forgets its own from the
first re-handed position on (`feature_proposers.EagleProposer`).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol, runtime_checkable

import torch

from .. import _checks
from ..generation.draft_heads import load_draft_heads
from ..generation.drafters import ModelDrafter
from ..generation.eagle import EagleDraft
from ..generation.medusa import MedusaHeads
from ..generation.prompt_lookup import prompt_lookup_propose
from ..generation.sampling import draw_next_token, invalid_rows
from ..generation.speculative_rule import accept_unchecked, greedy_accept
from ..model.transformer import TransformerLM
from .feature_proposers import EagleProposer, MedusaProposer, TargetFeatures
from .scheduler import ContinuousScheduler, ScheduledBatch
from .sequence import Sequence

SPECULATIVE_METHODS = ("prompt_lookup", "draft", "medusa", "eagle")


@runtime_checkable
class Proposer(Protocol):
    needs_features: bool

    def propose(self, seq: Sequence, n: int) -> tuple[list[int], torch.Tensor | None]: ...

    def observe(self, seq: Sequence, features: TargetFeatures) -> None: ...


class PromptLookupProposer:
    """Copy what followed the most recent earlier occurrence of the last n-gram (`prompt_lookup`).
    In the engine a draft costs a verify position even when it is wrong, so the default asks for a match
    of at least 2 tokens: a 1-token match proposes often and is often wrong."""

    needs_features = False

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        _checks.positive_ints(max_ngram=max_ngram, min_ngram=min_ngram)
        if min_ngram > max_ngram:
            raise ValueError(f"min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, seq: Sequence, n: int) -> tuple[list[int], None]:
        return prompt_lookup_propose(seq.token_ids, n, self.max_ngram, self.min_ngram), None

    def observe(self, seq: Sequence, features: TargetFeatures) -> None:
        pass


class DraftModelProposer:
    """A small draft `TransformerLM`, one `ModelDrafter` (its own contiguous KV cache) per sequence.
    Sampled drafts are drawn with the sequence's own generator, from the request's filtered distribution."""

    needs_features = False

    def __init__(self, model: TransformerLM, max_draft_tokens: int):
        _checks.instance("draft_model", model, TransformerLM, "a TransformerLM (e.g. load_pretrained('draft'))")
        self.model = model
        self.max_draft_tokens = _checks.positive_int("max_draft_tokens", max_draft_tokens)

    def propose(self, seq: Sequence, n: int) -> tuple[list[int], torch.Tensor | None]:
        drafter = seq.proposer_state
        if drafter is None:   # first decode (or a forked sibling): prefill the draft on all but the last token
            drafter = seq.proposer_state = ModelDrafter(self.model)
            drafter.start(seq.token_ids[:-1], seq.max_len, max_rollback=self.max_draft_tokens + 1)
        drafter.rollback(len(seq.token_ids) - 1)   # forget rejected drafts: token_ids is the truth
        return drafter.propose(seq.token_ids, n, seq.request.sampling, seq.generator)

    def observe(self, seq: Sequence, features: TargetFeatures) -> None:
        pass


class SpeculativeScheduler(ContinuousScheduler):
    """Continuous batching whose decodes carry drafts: 1 + k slots reserved, rolled back after verification."""

    policy = "continuous"

    def __init__(self, manager, max_num_seqs: int, max_num_batched_tokens: int, watermark_blocks: int | None,
                 chunked_prefill: bool, proposer: Proposer, num_speculative_tokens: int,
                 disable_by_batch_size: int | None = None):
        super().__init__(manager, max_num_seqs, max_num_batched_tokens, watermark_blocks, chunked_prefill)
        self.proposer = proposer
        self.num_speculative_tokens = _checks.positive_int("num_speculative_tokens", num_speculative_tokens)
        self.disable_by_batch_size = disable_by_batch_size   # None: always draft
        self.num_proposed = self.num_accepted = self.num_verified = 0   # drafts, kept drafts, rows with drafts

    def _reserve_decode_slots(self, batch: ScheduledBatch) -> list[Sequence]:
        """The base's loop (oldest first, preempt the youngest while no block is free), with 1 + k slots
        per decode; drafts are trimmed to the free blocks before anyone is preempted for them."""
        manager, queue, partial = self.manager, deque(self.running), []
        draft = self.disable_by_batch_size is None or len(self.running) <= self.disable_by_batch_size
        while queue:
            seq = queue.popleft()
            if manager.tables[seq.seq_id].num_tokens == len(seq.token_ids):  # a prefill cut short
                partial.append(seq)
                continue
            if draft:
                self._propose(seq, batch)
            while seq.draft_token_ids and \
                    manager.blocks_to_append(seq.seq_id, 1 + len(seq.draft_token_ids)) > manager.num_free_blocks:
                self._trim_drafts(seq, len(seq.draft_token_ids) - 1)
            while manager.append_needs_block(seq.seq_id) and manager.num_free_blocks == 0:
                victim = queue.pop() if queue else seq
                self._preempt(victim, batch)
                if victim is seq:
                    break
            else:  # no token_ids: the blocks are named after verification, once their tokens are final
                n = 1 + len(seq.draft_token_ids)
                batch.copies.extend(manager.allocate_slots(seq.seq_id, n))
                batch.decodes.append(seq)
                batch.num_scheduled_tokens[seq.seq_id] = n
                self.num_proposed += n - 1
                self.num_verified += n > 1
        return partial

    def _propose(self, seq: Sequence, batch: ScheduledBatch) -> None:
        """Ask the proposer for at most k drafts: one token must stay for the bonus within max_tokens,
        and the step's token budget (the decodes' 1 + k tokens count) must not overflow."""
        left = seq.request.sampling.max_tokens - (len(seq.token_ids) - seq.prompt_len) - 1
        budget = self.max_num_batched_tokens - batch.num_tokens - 1
        n = min(self.num_speculative_tokens, left, budget)
        tokens, probs = self.proposer.propose(seq, n) if n > 0 else ([], None)
        seq.draft_token_ids, seq.draft_probs = list(tokens[:n]), probs
        self._trim_drafts(seq, len(seq.draft_token_ids))

    @staticmethod
    def _trim_drafts(seq: Sequence, n: int) -> None:
        seq.draft_token_ids = seq.draft_token_ids[:n]
        if seq.draft_probs is not None:
            seq.draft_probs = seq.draft_probs[:n] if n else None

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self._trim_drafts(seq, 0)
        super()._preempt(seq, batch)

    def postprocess(self, batch: ScheduledBatch, sampled: list[list[int]], now: float) -> list[Sequence]:
        """Prefill rows as the base does; a decode row takes its emitted tokens (accepted drafts + one),
        and its table is rolled back to the tokens now computed."""
        num_prefills = len(batch.prefills)
        prefills_only = ScheduledBatch(prefills=batch.prefills, num_scheduled_tokens=batch.num_scheduled_tokens)
        got = super().postprocess(prefills_only, sampled[:num_prefills], now)
        for seq in got:
            seq.num_new_tokens = 1
        manager = self.manager
        for seq, tokens in zip(batch.decodes, sampled[num_prefills:], strict=True):
            self.num_accepted += len(tokens) - 1
            seq.num_computed_tokens += len(tokens)   # the last token and the accepted drafts: K/V final
            manager.truncate(seq.seq_id, seq.num_computed_tokens)
            self._trim_drafts(seq, 0)
            got.append(seq)
            seq.num_new_tokens = 0
            for token in tokens:
                seq.num_new_tokens += 1
                if seq.append(token, now):
                    self.finish(seq)
                    break
            else:
                manager.cache_blocks(seq.seq_id, seq.token_ids)   # name the blocks the accepted tokens filled
        return got


def speculative_sample(logits: torch.Tensor, batch: ScheduledBatch) -> list[list[int]]:
    """logits (R, V): one row per prefill (its last token), 1 + k rows per decode (its last token and
    its k drafts) -> per sequence the tokens it emits: a prefill's `samples_wanted` tokens (as `sample`),
    a decode's accepted drafts and one more token."""
    bad = invalid_rows(logits)                                           # (R,) on the device
    greedy = logits.argmax(-1)                                           # (R,)
    host = torch.cat([greedy, bad.long()]).tolist()                      # one copy for every greedy row
    R = logits.shape[0]
    argmax, bad_rows = host[:R], [r for r, flag in enumerate(host[R:]) if flag]
    spans = row_spans(batch)
    if bad_rows:
        names = sorted({seq.request.request_id for seq, (r, m) in zip(batch.sequences, spans)
                        if any(r <= b < r + m for b in bad_rows)}, key=str)
        raise ValueError(f"the model's logits are NaN or +inf (or allow no token) for requests {names}: a diverged "
                         f"model, or NaN weights?")
    out = []
    for seq, (r, m) in zip(batch.sequences, spans):
        params, drafts = seq.request.sampling, seq.draft_token_ids
        if params.temperature == 0:
            k, token = greedy_accept(drafts, argmax[r:r + m])
            out.append(drafts[:k] + [token] if drafts else [token] * batch.samples_wanted(seq))
        elif not drafts:   # a prefill (maybe forking its siblings) or a decode nothing was proposed for
            generators = ([seq.generator] + seq.pending_forks)[:batch.samples_wanted(seq)]
            out.append([int(draw_next_token(logits[r], params.temperature, params.top_k, params.top_p, g))
                        for g in generators])
        else:
            q = params.probs(logits[r:r + m])                                            # (k + 1, V)
            ids = torch.tensor(drafts, dtype=torch.long, device=logits.device)          # (k,)
            p = seq.draft_probs
            if p is None:   # deterministic drafts: one-hot
                p = torch.nn.functional.one_hot(ids, q.shape[-1]).to(q.dtype)
            k, token = accept_unchecked(p.to(q.dtype), q, ids, seq.generator)
            out.append(drafts[:k] + [token])
    return out


def row_spans(batch: ScheduledBatch) -> list[tuple[int, int]]:
    """(first row, rows) of each sequence in a verify step's logits: 1 per prefill, 1 + k per decode."""
    spans, row = [], 0
    for seq in batch.sequences:
        m = 1 + len(seq.draft_token_ids)
        spans.append((row, m))
        row += m
    return spans


def hand_features(proposer: Proposer, batch: ScheduledBatch, sampled: list[list[int]],
                  features: tuple[torch.Tensor, torch.Tensor]) -> None:
    """After postprocess: give every sequence still running the target's features at its newly final
    positions. `features`: the runner's (sum T, D) pair, one row per token the step ran, in the batch's
    order (each sequence's `num_scheduled_tokens` rows: a prefill's chunk, a decode's last token and drafts)."""
    last, second = features
    row, num_prefills = 0, len(batch.prefills)
    for i, (seq, tokens) in enumerate(zip(batch.sequences, sampled)):
        r, ran = row, batch.num_scheduled_tokens[seq.seq_id]
        row += ran
        if seq.finish_reason is not None:   # nothing will draft for it
            continue
        n = ran if i < num_prefills else len(tokens)   # a prefill's whole chunk; a decode's last token + accepted
        first = seq.num_computed_tokens - n
        proposer.observe(seq, TargetFeatures(list(range(first, first + n)), last[r:r + n], second[r:r + n]))


def make_proposer(method: str, num_speculative_tokens: int, draft_model, target: TransformerLM) -> Proposer:
    """The built-in proposer named by EngineConfig.speculative; `draft_model` is what it drafts with: a
    TransformerLM ("draft"), MedusaHeads ("medusa"), an EagleDraft ("eagle"), or None for "medusa" and
    "eagle" to load the shipped SmolLM2 ones. Checked against the target before anything is built."""
    if method == "prompt_lookup":
        if draft_model is not None:
            raise ValueError("draft_model is used only with speculative='draft', 'medusa' or 'eagle', got "
                             "speculative='prompt_lookup'")
        return PromptLookupProposer()
    if method == "draft":
        if draft_model is None:
            raise ValueError("speculative='draft' needs draft_model=a TransformerLM sharing the target's vocabulary")
        _checks.instance("draft_model", draft_model, TransformerLM, "a TransformerLM (e.g. load_pretrained('draft'))")
        if draft_model.config.vocab_size != target.config.vocab_size:
            raise ValueError(f"draft_model's vocab_size {draft_model.config.vocab_size} differs from the target's "
                             f"{target.config.vocab_size}; speculative decoding needs a shared vocabulary")
        return DraftModelProposer(draft_model, num_speculative_tokens)
    kind = MedusaHeads if method == "medusa" else EagleDraft
    if draft_model is None:   # the shipped heads: made for SmolLM2 (load_draft_heads checks d_model first)
        try:
            draft_model = load_draft_heads(target, f"{method}-smollm2")
        except ValueError as e:
            raise ValueError(f"speculative={method!r} without draft_model= loads the shipped SmolLM2 {method} "
                             f"asset: {e}. Pass draft_model={kind.__name__}(...) made for this target") from None
    _checks.instance("draft_model", draft_model, kind, f"{kind.__name__} for speculative={method!r}")
    if method == "medusa":   # the proposers check the heads against the target (d_model, vocabulary)
        return MedusaProposer(target, draft_model)
    return EagleProposer(target, draft_model, num_speculative_tokens)


__all__ = ["DraftModelProposer", "PromptLookupProposer", "Proposer", "SPECULATIVE_METHODS", "SpeculativeScheduler",
           "TargetFeatures", "hand_features", "make_proposer", "row_spans", "speculative_sample"]
