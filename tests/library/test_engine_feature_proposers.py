"""Medusa heads and an EAGLE draft as proposers inside the engine (`serving/feature_proposers.py`), with
seeded random heads on the toy target, against references written here: every proposal equals what the
heads draft from a full forward of the target over the sequence as it stands (for EAGLE: the draft run
without a cache over the target's features from the first position the engine computed), through
accepted runs, rejections, chunked prefill, prefix-cache hits and preemption; greedy outputs equal a
full-forward greedy loop; no block leaks; bad drafters raise before anything is built. (The sampled
law and the mixed trace are in test_engine_speculative.py's parametrisations.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cs336_inference.generation.draft_vocab import set_vocab
from cs336_inference.generation.eagle import EagleDraft, eagle_config
from cs336_inference.generation.medusa import MedusaHeads
from cs336_inference.model import load_pretrained
from cs336_inference.serving import Engine, SamplingParams
from cs336_inference.serving import speculative as speculative_module
from cs336_inference.serving.feature_proposers import EagleProposer, MedusaProposer
from cs336_inference.serving.speculative import Proposer, TargetFeatures
from test_medusa import restricted
from test_engine_speculative import _drain, full_forward_features, greedy_reference, plain_and_speculative_outputs

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


def random_medusa(model, num_heads=4, seed=0, vocab=None) -> MedusaHeads:
    heads = MedusaHeads(model.config.d_model, num_heads)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in heads.proj:
            w.weight.copy_(0.1 * torch.randn(w.weight.shape, generator=gen))
    set_vocab(heads, vocab, model.config.vocab_size)
    return heads.eval()


def random_eagle(model, seed=0, vocab=None) -> EagleDraft:
    torch.manual_seed(seed)
    draft = EagleDraft(eagle_config(model.config)).eval()
    set_vocab(draft, vocab, model.config.vocab_size)
    return draft


@torch.no_grad()
def reference_medusa_logits(model, heads, tokens, n):
    """Head k's logits from the target's feature at the last final position: lm_head(h + SiLU(W_k h))."""
    last, _ = full_forward_features(model, tokens)
    h = model.ln_final(last[len(tokens) - 2])
    return [restricted(model.lm_head(h + F.silu(h @ w.weight.T)), heads.vocab) for w in heads.proj[:n]]


@torch.no_grad()
def reference_eagle_logits(model, draft, tokens, base, drafts):
    """The draft without a cache: its input at step t is (h_t, embed(x_{t+1})) for t = base .. L-2 from the
    target's full forward (h = ln_final(f), the LM head's input), then its own predicted features with the
    drafted tokens; logits of each step."""
    last, _ = full_forward_features(model, tokens)
    feats, nxt, out = model.ln_final(last[base:len(tokens) - 1]), list(tokens[base + 1:]), []
    for token in drafts:
        f = draft(feats[None], model.token_embeddings(torch.tensor([nxt])))[0, -1]         # (D,)
        out.append(restricted(model.lm_head(f), draft.vocab))
        feats, nxt = torch.cat([feats, f[None]]), nxt + [token]
    return out


def recording(cls):
    """The proposer under test, recording every proposal (the sequence as it stood, the first position its
    features start from, the drafts), then proposing the reference continuation instead (wrong at a fixed
    place every third call): long accepted runs, rejections and rollbacks at known points."""

    class Recording(cls):
        def __init__(self, references, *args):
            super().__init__(*args)
            self.references, self.records, self.calls, self.sequences = references, [], 0, {}

        def propose(self, seq, n):
            drafts, probs = super().propose(seq, n)
            assert probs is None and len(drafts) <= n
            state = seq.proposer_state
            self.records.append((list(seq.token_ids), state.base if state else None, drafts, seq))
            self.sequences[seq.seq_id] = seq
            done = len(seq.token_ids) - seq.prompt_len
            oracle = list(self.references[seq.request.prompt][done:done + n])
            self.calls += 1
            if oracle and self.calls % 3 == 0:
                oracle[self.calls % len(oracle)] = (oracle[self.calls % len(oracle)] + 1) % 257
            return oracle, None

    return Recording


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_engine_proposals_equal_a_from_scratch_reference_through_rollback_and_preemption(model, text, kind):
    shared = text[0:16]   # four full blocks: the later requests take them from the prefix cache
    prompts = [shared + text[40:47], text[100:131], shared + text[300:305], text[500:509], shared + text[700:703]]
    max_tokens = 22
    full = {tuple(p): greedy_reference(model, p, max_tokens) for p in prompts}
    vocab = torch.arange(0, model.config.vocab_size, 2)   # drafts rank the even ids only (`draft_vocab`)
    if kind == "medusa":
        heads = random_medusa(model, vocab=vocab)
        proposer = recording(MedusaProposer)(full, model, heads)
    else:
        draft = random_eagle(model, vocab=vocab)
        proposer = recording(EagleProposer)(full, model, draft, 4)
    engine = Engine(model, proposer=proposer, num_speculative_tokens=4, block_size=4, max_num_seqs=4,
                    max_num_batched_tokens=24, chunked_prefill=True, num_blocks=18, step_time=lambda b: 0.001)
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=max_tokens), request_id=i, arrival_time=0.002 * i)
    out = _drain(engine)
    assert [out[(i, 0)][0] for i in range(len(prompts))] == [full[tuple(p)] for p in prompts]
    assert engine.manager.num_free_blocks == engine.num_blocks and not engine.manager.tables   # nothing leaked
    seqs = proposer.sequences.values()
    assert any(s.num_preemptions > 0 for s in seqs), "no preemption: the test did not exercise recompute"
    assert any(s.num_cached_tokens > 0 for s in seqs), "no prefix-cache hit"
    assert 0 < engine.scheduler.num_accepted < engine.scheduler.num_proposed
    assert all(s.proposer_state.drafter.head is proposer.head for s in seqs)   # one copy of the head's rows
    checked = 0
    for tokens, base, drafts, seq in proposer.records:
        if not drafts:   # allowed only before the first feature of the newest position arrived (a fork, none here)
            assert base is None, (len(tokens), base)
            continue
        if kind == "medusa":
            logits = reference_medusa_logits(model, heads, tokens, len(drafts))
        else:   # features from the first position the engine computed for it (after the prefix-cache hit)
            assert base == seq.num_cached_tokens
            logits = reference_eagle_logits(model, draft, tokens, base, drafts)
        for token, row in zip(drafts, logits, strict=True):
            assert token % 2 == 0 and row[token] >= row.max() - 1e-4, \
                f"draft {token} is not the reference's argmax {int(row.argmax())}"
        checked += len(drafts)
    assert checked > 50
    assert len(proposer.records) > 20 and all(r[2] for r in proposer.records[-5:])


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_greedy_outputs_equal_the_plain_engine_with_preemption(model, text, kind):
    """The proposers' own drafts (random heads ranking the even ids only: mostly rejected), a pool small
    enough to preempt."""
    prompts = [text[0:30], text[200:212], text[0:30] + text[400:404], text[900:925]]
    vocab = torch.arange(0, model.config.vocab_size, 2)
    draft = random_medusa(model, seed=1, vocab=vocab) if kind == "medusa" else random_eagle(model, seed=1, vocab=vocab)
    options = dict(block_size=4, max_num_seqs=4, num_blocks=26, max_num_batched_tokens=20, chunked_prefill=True)
    outputs, preempted = [], []
    for spec in ({}, dict(speculative=kind, draft_model=draft)):
        engine = Engine(model, num_speculative_tokens=3, **options, **spec)
        preempt = engine.scheduler._preempt
        engine.scheduler._preempt = lambda seq, batch, preempt=preempt, on=bool(spec): preempted.append(on) or \
            preempt(seq, batch)
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_tokens=20), request_id=i)
        out = _drain(engine)
        outputs.append([out[(i, 0)][0] for i in range(len(prompts))])
        assert engine.manager.num_free_blocks == engine.num_blocks
    assert outputs[1] == outputs[0] == [greedy_reference(model, p, 20) for p in prompts]
    assert engine.scheduler.num_proposed > 30
    assert isinstance(engine.proposer, MedusaProposer if kind == "medusa" else EagleProposer)
    assert True in preempted, "no preemption: the test did not exercise recompute"


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_sampled_drafts_use_the_requests_own_generator(model, text, kind):
    """A seeded request's output does not depend on the global RNG: the drafts are drawn from its generator."""
    heads = random_medusa(model, seed=3) if kind == "medusa" else random_eagle(model, seed=3)
    outputs = []
    for global_seed in (0, 1):
        torch.manual_seed(global_seed)
        engine = Engine(model, speculative=kind, draft_model=heads, num_speculative_tokens=3, block_size=4)
        for i, p in enumerate((text[0:20], text[300:311])):
            engine.add_request(p, SamplingParams(1.0, max_tokens=16, seed=11 + i), request_id=i)
        out = _drain(engine)
        outputs.append([out[(i, 0)][0] for i in range(2)])
        assert engine.scheduler.num_proposed > 10
    assert outputs[0] == outputs[1]


@torch.no_grad()
def test_eagle_state_after_refed_and_missing_positions_equals_a_fresh_drafts(model, text):
    """What a preemption's recompute (positions handed again, from inside the draft's cache or from its
    pending features) and a gap or an earlier start (a fresh draft from there) leave: every proposal equals
    the reference draft run without a cache from the first position it was given. Medusa and EAGLE draft
    nothing while the last final position's feature is missing."""
    from cs336_inference.serving.request import Request
    from cs336_inference.serving.sequence import Sequence

    prompt = text[0:20]
    tokens = prompt + greedy_reference(model, prompt, 14)
    last, second = full_forward_features(model, tokens)
    draft = random_eagle(model, seed=2)
    eagle, medusa = EagleProposer(model, draft, 3), MedusaProposer(model, random_medusa(model, seed=2))
    seq = Sequence(0, Request(0, tuple(prompt), 14, 0.0, SamplingParams(max_tokens=14)))

    def hand(first, end):   # the target's features at positions first .. end - 1
        f = TargetFeatures(list(range(first, end)), last[first:end], second[first:end])
        eagle.observe(seq, f)

    def check(length, base):
        seq.token_ids = tokens[:length]
        drafts, probs = eagle.propose(seq, 3)
        assert seq.proposer_state.base == base and probs is None and len(drafts) == 3
        for token, row in zip(drafts, reference_eagle_logits(model, draft, seq.token_ids, base, drafts)):
            assert row[token] >= row.max() - 1e-4

    seq.token_ids = tokens[:20]
    assert eagle.propose(seq, 3) == ([], None) and medusa.propose(seq, 3) == ([], None)   # nothing handed yet
    hand(0, 19)
    check(20, 0)
    hand(19, 22)
    hand(20, 22)              # handed again from inside the pending features
    check(23, 0)
    hand(22, 25)
    hand(8, 25)               # handed again from inside the draft's cache
    check(26, 0)
    hand(25, 26)
    seq.token_ids = tokens[:28]
    assert eagle.propose(seq, 3) == ([], None)   # position 26 never handed: nothing to draft from
    hand(27, 29)              # a gap: a fresh draft from position 27
    check(30, 27)
    hand(20, 30)              # before the draft's first position: a fresh draft from 20
    check(31, 20)
    medusa.observe(seq, TargetFeatures([29], last[29:30], second[29:30]))
    seq.token_ids = tokens[:32]
    assert medusa.propose(seq, 3) == ([], None)   # the feature of position 30 is missing


def test_bad_feature_drafters_raise_before_anything_is_built(model, monkeypatch):
    import adapters
    from test_speculative_decoding import TINY

    def built(*args, **kwargs):
        raise AssertionError("a draft model's proposer was built before its drafter was checked")

    # a draft model's proposer holds state (its drafters' caches): make_proposer checks before building it;
    # the Medusa and EAGLE proposers hold none and check their heads themselves, also when built directly
    monkeypatch.setattr(speculative_module, "DraftModelProposer", built)
    small = adapters.make_model(adapters.make_config(**TINY))
    with pytest.raises(ValueError, match="vocab"):
        Engine(model, speculative="draft", draft_model=small)
    with pytest.raises(ValueError, match="vocab_size"):
        EagleProposer(model, EagleDraft(eagle_config(model.config).replace(vocab_size=300)), 4)
    with pytest.raises(ValueError, match="d_model"):
        MedusaProposer(model, MedusaHeads(96, 2))
    with pytest.raises(ValueError, match="d_model"):
        Engine(model, speculative="medusa", draft_model=MedusaHeads(96, 2))
    with pytest.raises(ValueError, match="d_model"):
        Engine(model, speculative="eagle", draft_model=EagleDraft(eagle_config(model.config).replace(d_model=96,
                                                                                                      num_heads=2,
                                                                                                      num_kv_heads=2)))
    with pytest.raises(ValueError, match="vocab_size"):
        Engine(model, speculative="eagle", draft_model=EagleDraft(eagle_config(model.config).replace(vocab_size=300)))
    with pytest.raises(TypeError, match="draft_model"):
        Engine(model, speculative="eagle", draft_model=MedusaHeads(model.config.d_model, 2))
    with pytest.raises(TypeError, match="draft_model"):
        Engine(model, speculative="medusa", draft_model=random_eagle(model))
    with pytest.raises(ValueError, match="shipped SmolLM2"):   # the shipped heads are made for SmolLM2's d_model
        Engine(model, speculative="medusa")
    with pytest.raises(ValueError, match="shipped SmolLM2"):
        Engine(model, speculative="eagle")
    with pytest.raises(ValueError, match="draft_model is used only"):
        Engine(model, speculative="prompt_lookup", draft_model=random_eagle(model))
    monkeypatch.undo()
    assert isinstance(MedusaProposer(model, random_medusa(model)), Proposer)
    assert isinstance(EagleProposer(model, random_eagle(model), 4), Proposer)
    with pytest.raises(ValueError, match="max_draft_tokens"):
        EagleProposer(model, random_eagle(model), 0)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_smollm2_shipped_heads_in_the_engine_equal_the_plain_engine(kind):
    from cs336_inference.data.real_text import prose_paragraphs
    from cs336_inference.generation.draft_heads import ASSETS, SHIPPED
    from cs336_inference.model.real_models import real_model_missing
    from cs336_inference.model.tokenizer import load_tokenizer

    if missing := real_model_missing("smollm2-135m"):
        pytest.skip(missing)
    if not (ASSETS / SHIPPED[f"{kind}-smollm2"]).exists():
        pytest.skip(f"{SHIPPED[f'{kind}-smollm2']} is not installed")
    model, tok = load_pretrained("smollm2-135m").eval(), load_tokenizer("smollm2-135m")
    paragraphs = prose_paragraphs()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": task + paragraphs[1 + 5 * i][:400]}]))
               for i, task in enumerate(("Summarize the following passage:\n\n", "Rewrite the following passage:\n\n"))]
    params = SamplingParams(max_tokens=24, stop_token_ids=tuple(tok.stop_ids))
    outputs, engine = plain_and_speculative_outputs(model, prompts, params, dict(speculative=kind),  # shipped heads
                                                    max_num_seqs=2, num_speculative_tokens=4)
    assert outputs[1] == outputs[0]
    assert engine.scheduler.num_accepted > 5   # trained heads: drafts the target keeps
