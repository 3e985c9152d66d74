"""`LookupThenDraft` (`generation.lookup_then_draft`): prompt lookup where the last 2-4 tokens occur
earlier, the fallback drafter otherwise. Each pass's source is the one a plain n-gram search written
here predicts, greedy output equals plain greedy decoding with every kind of fallback, the sampled
output follows the target (chi-square, false-failure rate < 1e-4), the EAGLE fallback proposes what a
fresh EAGLE drafter fed the same sequence proposes however many passes lookup took, bad inputs are refused."""

import pytest
import torch
from cs336_inference.generation import (EagleDraft, EagleDrafter, LookupThenDraft, MedusaDrafter, MedusaHeads,
                                        ModelDrafter, PromptLookupDrafter, SamplingParams, generate,
                                        speculative_generate)
from cs336_inference.generation.draft_training import train_eagle
from cs336_inference.generation.eagle import eagle_config
from cs336_inference.generation.speculative import SpeculativeDecoder
from cs336_inference.model import load_pretrained
from test_medusa import lm_head_input, ln_final_input, one_thread_only, toy_data
from test_speculative_decoding import _cache_tensors, sampled_law_p_value, tiny_pair

# byte prompts that repeat phrases, so some passes find an earlier copy and some do not
PROMPTS = (b"the cat sat on the mat. the dog sat on the log. the cat sat on the ",
           b"Once upon a time, a king said: once upon a time, a ")


@pytest.fixture(scope="module")
def toy():
    """The toy target and an EAGLE draft trained on it for a few seconds (as test_eagle's)."""
    target, data = toy_data()
    with one_thread_only():
        draft, _ = train_eagle(target, data, steps=60, window=24, batch_size=4, lr=3e-3, log_every=59)
    return target, draft


def reference_lookup(seq: list[int], n: int, max_ngram: int = 4, min_ngram: int = 2) -> list[int]:
    """The test's own search: the longest suffix (max_ngram down to min_ngram tokens) that occurs
    earlier, the n tokens after its most recent earlier occurrence; [] when none occurs."""
    for size in range(max_ngram, min_ngram - 1, -1):
        if size >= len(seq):
            continue
        suffix = seq[-size:]
        for j in range(len(seq) - size - 1, -1, -1):   # earlier starts, most recent first
            if seq[j:j + size] == suffix:
                return seq[j + size:j + size + n]
    return []


class RecordingEagle(EagleDrafter):
    """An EAGLE drafter that records every proposal: (sequence, n, generator state before, tokens, probs)."""

    def __init__(self, target, draft):
        super().__init__(target, draft)
        self.log = []

    def propose(self, sequence, n, sampling, generator=None):
        state = generator.get_state() if generator is not None else None
        tokens, probs = super().propose(sequence, n, sampling, generator)
        self.log.append((list(sequence), n, state, tokens, probs))
        return tokens, probs


def _fallbacks(target, draft):
    return {"eagle": EagleDrafter(target, draft),
            "medusa": MedusaDrafter(target, MedusaHeads(target.config.d_model, 2)),
            "model": ModelDrafter(load_pretrained("draft"))}


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_output_equals_plain_greedy_decoding_with_every_fallback(toy, one_thread, gamma):
    target, draft = toy
    for name, fallback in _fallbacks(target, draft).items():
        used = {"lookup": 0, "draft": 0}
        for text in PROMPTS:
            prompt = list(text)
            want = generate(target, [prompt], 40).tokens[0]
            drafter = LookupThenDraft(fallback)
            out = speculative_generate(target, drafter, prompt, gamma, max_new_tokens=40)
            assert out.tokens == want, (name, text)
            assert max(out.proposed) <= gamma, (name, out.proposed)
            assert drafter.lookup_passes + drafter.draft_passes == sum(1 for g in out.proposed if g), name
            used["lookup"] += drafter.lookup_passes
            used["draft"] += drafter.draft_passes
        assert used["lookup"] > 0 and used["draft"] > 0, f"{name}: one source never proposed ({used})"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@torch.inference_mode()
def test_each_pass_copies_exactly_when_an_earlier_ngram_matches(toy, one_thread, temperature):
    target, draft = toy
    gen = torch.Generator().manual_seed(3)
    for text in PROMPTS:
        dec = SpeculativeDecoder(target, LookupThenDraft(EagleDrafter(target, draft)), list(text), 4, temperature,
                                 max_new_tokens=40, generator=gen)
        while not dec.finished:
            n = min(4, dec.max_new_tokens - len(dec.result.tokens) - 1)
            copy = reference_lookup(dec.sequence, n)
            before = (dec.drafter.lookup_passes, dec.drafter.draft_passes)
            new = dec.step()
            g, k = dec.result.proposed[-1], dec.result.accepted[-1]
            if n == 0:
                assert g == 0 and (dec.drafter.lookup_passes, dec.drafter.draft_passes) == before
            elif copy:   # lookup proposed exactly the copy; the accepted drafts are its first k tokens
                assert (dec.drafter.lookup_passes, dec.drafter.draft_passes) == (before[0] + 1, before[1])
                assert g == len(copy) and new[:k] == copy[:k]
            else:        # the EAGLE draft proposed n tokens
                assert (dec.drafter.lookup_passes, dec.drafter.draft_passes) == (before[0], before[1] + 1)
                assert g == n


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@torch.inference_mode()
def test_the_eagle_fallback_proposes_what_a_fresh_one_fed_the_sequence_proposes(toy, one_thread, temperature):
    """However many passes lookup proposed in between, the fallback's cache holds exactly the positions
    computed from the target's true features and its next proposal is a fresh drafter's on the same sequence."""
    target, draft = toy
    sampling = SamplingParams(temperature)
    checked, streaks = 0, []   # lookup passes just before each fallback proposal
    for text in PROMPTS:
        fallback = RecordingEagle(target, draft)
        dec = SpeculativeDecoder(target, LookupThenDraft(fallback), list(text), 4, temperature, max_new_tokens=40,
                                 generator=torch.Generator().manual_seed(5))
        lookup_since_draft = 0
        while not dec.finished:
            lookups = dec.drafter.lookup_passes
            dec.step()
            seq, n = dec.sequence, fallback.cache.length
            # the draft's cache: only positions computed from true features, equal to a fresh cache's
            assert n == fallback.true_len and n <= len(seq) - 2
            h = lm_head_input(target, torch.tensor([seq]))        # the target's features after its final norm
            fresh_cache = draft.new_cache(fallback.cache.max_seq_len)
            if n:
                draft(h[:, :n], target.token_embeddings(torch.tensor([seq[1:n + 1]])), fresh_cache)
            for got, want in zip(_cache_tensors(fallback.cache, n), _cache_tensors(fresh_cache, n), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(torch.cat(fallback.pending), h[0, n:len(seq) - 1], rtol=1e-4, atol=1e-4)
            lookup_since_draft += dec.drafter.lookup_passes - lookups
            if len(fallback.log) > checked:   # the fallback proposed in this pass: compare with a fresh drafter
                sequence, m, state, tokens, probs = fallback.log[-1]
                _, f = ln_final_input(target, torch.tensor([sequence]))
                fresh = EagleDrafter(target, draft)
                fresh.start(sequence, len(sequence) + m + 1)
                fresh.observe(f[0, :len(sequence) - 1])
                gen = None if state is None else torch.Generator().set_state(state)
                want_tokens, want_probs = fresh.propose(sequence, m, sampling, gen)
                assert tokens == want_tokens
                if probs is None:
                    assert want_probs is None
                else:
                    torch.testing.assert_close(probs, want_probs, rtol=1e-4, atol=1e-5)
                streaks.append(lookup_since_draft)
                checked, lookup_since_draft = len(fallback.log), 0
    assert max(streaks) >= 2, f"the fallback never proposed after several lookup passes ({streaks}): the test did " \
                              "not exercise the hand-over"


class CountingLookupThenDraft(LookupThenDraft):
    """Keeps each source's passes over every sequence (`start` resets the per-sequence counts)."""

    totals = (0, 0)

    def start(self, prompt, max_seq_len, max_rollback=1):
        self.totals = (self.totals[0] + self.lookup_passes, self.totals[1] + self.draft_passes)
        super().start(prompt, max_seq_len, max_rollback)


def test_sampled_tokens_follow_the_target_chi_square(one_thread):
    # Joint law of the first 4 tokens (256 cells, small ones pooled) over 2000 runs at gamma = 2, after a
    # prompt holding 5 of the 16 token pairs: whether a pass copies or drafts depends on the tokens sampled
    # before it (each source proposes in about half the passes). False-failure rate 1e-4.
    target, _ = tiny_pair("bad")
    torch.manual_seed(4)
    drafter = CountingLookupThenDraft(EagleDrafter(target, EagleDraft(eagle_config(target.config))))
    p = sampled_law_p_value(target, drafter, [0, 1, 2, 3, 1, 2], k=4, gamma=2, runs=2000, seed=6,
                            temperature=1.0)
    drafter.start([0], 1)
    assert min(drafter.totals) > 200, f"one source rarely proposed: (lookup, draft) passes {drafter.totals}"
    assert p > 1e-4, f"lookup-then-EAGLE samples do not follow the target (p = {p:.2e})"


def test_bad_inputs_are_refused(toy):
    target, draft = toy
    with pytest.raises(TypeError, match="fallback must be a Drafter.*got TransformerLM"):
        LookupThenDraft(target)
    with pytest.raises(TypeError, match="fallback must be a Drafter.*got str"):
        LookupThenDraft("eagle")
    with pytest.raises(ValueError, match=r"min_ngram \(3\) must be <= max_ngram \(2\)"):
        LookupThenDraft(PromptLookupDrafter(), max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="min_ngram"):
        LookupThenDraft(PromptLookupDrafter(), min_ngram=0)
    with pytest.raises((TypeError, ValueError), match="max_ngram"):
        LookupThenDraft(PromptLookupDrafter(), max_ngram=2.5)
    # what the loop checks on a plain fallback, it checks behind the lookup too
    other = load_pretrained("target")
    with pytest.raises(ValueError, match="another model's features"):
        speculative_generate(target, LookupThenDraft(EagleDrafter(other, draft)), list(b"abc"), 2, max_new_tokens=4)
    small_vocab, _ = tiny_pair("good")
    with pytest.raises(ValueError, match="vocabularies differ"):
        speculative_generate(target, LookupThenDraft(ModelDrafter(small_vocab)), list(b"abc"), 2, max_new_tokens=4)
    # features are computed only for a fallback that reads them
    assert hasattr(LookupThenDraft(EagleDrafter(target, draft)), "observe")
    assert not hasattr(LookupThenDraft(ModelDrafter(load_pretrained("draft"))), "observe")
