"""Speculative decoding inside the serving engine (`serving/speculative.py`), against references
written here: greedy outputs equal a full-forward greedy loop (and the plain engine) on a mixed trace;
sampled outputs follow the target's own joint law (chi-square, fixed seeds, false-failure rate < 1e-4);
a rollback frees only the rejected drafts' blocks (a shared prefix block keeps its contents and its
count); no block leaks; bad configurations raise ValueError/TypeError naming the option."""

from __future__ import annotations

import copy

import pytest
import torch

import adapters
from cs336_inference.generation.eagle import EagleDraft, eagle_config
from cs336_inference.generation.medusa import MedusaHeads
from cs336_inference.model import load_pretrained
from cs336_inference.serving import Engine, SamplingParams
from cs336_inference.serving.kv_cache_manager import KVCacheManager
from cs336_inference.serving.speculative import PromptLookupProposer, Proposer
from test_speculative_decoding import TINY, target_joint_law
from test_speculative_rule import chi_square_p_value

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


@torch.no_grad()
def greedy_reference(model, prompt, max_tokens, stop=()):
    """The test's own greedy loop: a full forward over the whole sequence per token, no cache."""
    seq, out = list(prompt), []
    while len(out) < max_tokens:
        token = int(model(torch.tensor([seq]))[0, -1].argmax())
        seq.append(token)
        out.append(token)
        if token in stop:
            break
    return out


class OracleProposer:
    """Drafts the reference continuation, wrong at a fixed place every third step: long accepted runs
    (stop tokens and max_tokens land inside them) and rejections (rollbacks) at known points."""

    needs_features = False

    def __init__(self, references: dict, vocab_size: int):
        self.references, self.vocab_size, self.calls = references, vocab_size, 0

    def propose(self, seq, n):
        done = len(seq.token_ids) - seq.prompt_len
        drafts = list(self.references[seq.request.prompt][done:done + n])
        self.calls += 1
        if drafts and self.calls % 3 == 0:   # one wrong token: everything from it on is rejected
            j = self.calls % len(drafts)
            drafts[j] = (drafts[j] + 1) % self.vocab_size
        return drafts, None

    def observe(self, seq, features):
        pass


def _drain(engine, limit=5000):
    streams = {}
    for _ in range(limit):
        if not engine.has_unfinished():
            return streams
        for out in engine.step():
            tokens, reasons = streams.setdefault((out.request_id, out.index), ([], []))
            tokens.extend(out.new_token_ids)
            reasons.append(out.finish_reason)
    raise AssertionError("the engine did not finish")


def plain_and_speculative_outputs(model, prompts, params, speculative: dict, **engine_kwargs) -> tuple[list, Engine]:
    """Each prompt's tokens from an engine without speculation and one with `speculative` (Engine options), the
    requests arriving 10 ms apart; each engine must end with every block free. Returns ([plain, speculative],
    the speculative engine)."""
    outputs = []
    for options in ({}, speculative):
        engine = Engine(model, block_size=16, num_blocks=64, **engine_kwargs, **options)
        for i, p in enumerate(prompts):
            engine.add_request(p, params, request_id=i, arrival_time=0.01 * i)
        out = _drain(engine)
        outputs.append([out[(i, 0)][0] for i in range(len(prompts))])
        assert engine.manager.num_free_blocks == engine.num_blocks
    return outputs, engine


def _spy_ends(engine) -> list:
    """(finish_reason, tokens the last step emitted, tokens the sequence kept) of every sequence that ends."""
    ends, postprocess = [], engine.scheduler.postprocess

    def spy(batch, sampled, now):
        emitted = {s.seq_id: len(t) for s, t in zip(batch.sequences, sampled)}
        got = postprocess(batch, sampled, now)
        ends.extend((s.finish_reason, emitted[s.seq_id], s.num_new_tokens) for s in got if s.finish_reason)
        return got

    engine.scheduler.postprocess = spy
    return ends


def _mixed_trace(text):
    """Staggered arrivals, a shared 24-token prefix, a long prompt (chunked), different lengths."""
    shared = text[0:24]
    return [  # (prompt, max_tokens, arrival)
        (text[0:40], 20, 0.0), (shared + text[300:309], 14, 0.0), (text[100:170], 18, 0.0),
        (shared + text[500:503], 9, 0.002), (text[700:705], 16, 0.004), (shared + text[300:309], 6, 0.006),
    ]


def _add_all(engine, trace, stops):
    for i, (prompt, max_tokens, arrival) in enumerate(trace):
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, stop_token_ids=stops.get(i, ())),
                           request_id=i, arrival_time=arrival)


def _first_new_token(sequence, start):
    """The first position >= start whose token did not occur before it (a stop token there ends the output there)."""
    return next(i for i in range(start, len(sequence)) if sequence[i] not in sequence[:i])


def random_heads(target, kind: str, seed: int = 0):
    """Seeded random Medusa heads (the zero init would repeat the target's guess) or an EAGLE draft."""
    torch.manual_seed(seed)
    if kind == "medusa":
        heads = MedusaHeads(target.config.d_model, 3)
        with torch.no_grad():
            for w in heads.proj:
                w.weight.normal_(0, 1.0 / target.config.d_model ** 0.5)
        return heads.eval()
    return EagleDraft(eagle_config(target.config)).eval()


@pytest.mark.parametrize("proposer", ["oracle", "prompt_lookup", "medusa", "eagle"])
def test_greedy_mixed_trace_equals_reference_and_plain_engine(model, text, proposer):
    trace = _mixed_trace(text)
    full = {tuple(p): greedy_reference(model, p, 24) for p, _, _ in trace}
    stops = {0: (full[tuple(trace[0][0])][_first_new_token(full[tuple(trace[0][0])], 6)],),
             2: (full[tuple(trace[2][0])][_first_new_token(full[tuple(trace[2][0])], 9)],)}
    expected = {i: greedy_reference(model, p, m, stops.get(i, ())) for i, (p, m, _) in enumerate(trace)}
    options = dict(block_size=4, max_num_seqs=4, max_num_batched_tokens=32, chunked_prefill=True, num_blocks=64,
                   step_time=lambda batch: 0.001)
    plain = Engine(model, **options)
    _add_all(plain, trace, stops)
    spec_options = {"oracle": lambda: dict(proposer=OracleProposer(full, model.config.vocab_size)),
                    "prompt_lookup": lambda: dict(speculative="prompt_lookup")}.get(
        proposer, lambda: dict(speculative=proposer, draft_model=random_heads(model, proposer)))()
    spec = Engine(model, num_speculative_tokens=4, **options, **spec_options)
    _add_all(spec, trace, stops)
    ends = _spy_ends(spec)
    plain_out, spec_out = _drain(plain), _drain(spec)
    for i in range(len(trace)):
        assert spec_out[(i, 0)][0] == expected[i], f"request {i}"
        assert plain_out[(i, 0)][0] == expected[i], f"request {i} (plain engine)"
        assert spec_out[(i, 0)][1][-1] == plain_out[(i, 0)][1][-1]   # the same finish reason
    assert spec.scheduler.num_proposed > 0 and (spec.scheduler.num_accepted > 0 or proposer in ("medusa", "eagle"))
    assert spec.manager.num_free_blocks == spec.num_blocks and not spec.manager.tables   # nothing leaked
    spec.manager.check_invariants()
    if proposer == "oracle":   # the trace exercised what it is meant to
        assert spec.scheduler.num_accepted < spec.scheduler.num_proposed        # rejections: rollbacks
        # a stop token inside an accepted run (the tokens after it dropped), and max_tokens reached by
        # an accepted run (the scheduler never drafts past it: the run ends exactly there)
        assert any(r == "stop" and kept < emitted for r, emitted, kept in ends), ends
        assert any(r == "length" and kept == emitted > 1 for r, emitted, kept in ends), ends
        assert all(r != "length" or kept == emitted for r, emitted, kept in ends), ends


def test_draft_model_greedy_equals_reference_and_frees_everything(model, text):
    draft = load_pretrained("draft").eval()
    prompts = [text[0:30], text[200:212], text[0:30] + text[400:404]]
    engine = Engine(model, speculative="draft", draft_model=draft, num_speculative_tokens=3, block_size=4,
                    max_num_seqs=3, num_blocks=48)
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=12), request_id=i)
    out = _drain(engine)
    for i, p in enumerate(prompts):
        assert out[(i, 0)][0] == greedy_reference(model, p, 12)
    assert 0 < engine.scheduler.num_accepted <= engine.scheduler.num_proposed
    assert engine.manager.num_free_blocks == engine.num_blocks


def test_rollback_leaves_a_shared_prefix_block_untouched(model, text):
    """Two requests share two full prompt blocks (prefix cache) and each has two forked samples (a shared,
    partly filled last block): every step's rollback frees only blocks its drafts took, and the shared
    blocks' K/V and counts stay exactly what they were after admission."""
    prompt_a, prompt_b = text[0:8] + text[40:43], text[0:8] + text[90:93]
    full = {tuple(p): greedy_reference(model, p, 20) for p in (prompt_a, prompt_b)}
    engine = Engine(model, proposer=OracleProposer(full, model.config.vocab_size), num_speculative_tokens=4,
                    block_size=4, max_num_seqs=4, num_blocks=40)
    freed, truncate = [], engine.manager.truncate
    engine.manager.truncate = lambda seq_id, n: freed.append(truncate(seq_id, n)) or freed[-1]
    for i, p in enumerate((prompt_a, prompt_b)):
        engine.add_request(p, SamplingParams(max_tokens=20, n=2), request_id=i)
    engine.step()   # both prefills (the second shares the first's two full blocks in the same step)
    engine.step()   # first decodes: copy-on-write of the shared last blocks
    tables = [engine.manager.tables[s.seq_id].blocks for s in engine.scheduler.running]
    shared = sorted(set(tables[0][:2]))
    assert len(tables) == 4 and all(t[:2] == shared for t in tables)
    pool = engine.manager.pool
    counts = [pool.ref_count(b) for b in shared]
    assert counts == [4, 4] and all(pool.is_named(b) for b in shared)
    layer = engine.runner.cache.layers[0]
    before = [(layer.k[b].clone(), layer.v[b].clone()) for b in shared]
    freed.clear()
    while True:
        engine.step()
        if len(engine.scheduler.running) < 4:   # a request finished: its blocks may go now
            break
        assert [pool.ref_count(b) for b in shared] == counts
        for b, (k, v) in zip(shared, before):
            assert torch.equal(layer.k[b], k) and torch.equal(layer.v[b], v)
        rolled_back = sum(freed)
    assert rolled_back > 0, "no rollback freed a block: the test did not exercise rollback"
    _drain(engine)
    assert engine.manager.num_free_blocks == engine.num_blocks


class FeatureOracle(OracleProposer):
    """The oracle's drafts, and what a Medusa/EAGLE proposer would read: every feature handed to it."""

    needs_features = True

    def __init__(self, references, vocab_size):
        super().__init__(references, vocab_size)
        self.seen = []

    def observe(self, seq, features):
        self.seen.append((list(seq.token_ids), features))


@torch.no_grad()
def full_forward_features(model, tokens):
    """The test's own reference: a full forward (no cache), keeping the input of the final norm and of the
    last layer at every position."""
    kept = {}
    hooks = [model.ln_final.register_forward_pre_hook(lambda m, a: kept.__setitem__("last", a[0][0])),
             model.layers[-1].register_forward_pre_hook(lambda m, a: kept.__setitem__("second", a[0][0]))]
    try:
        model(torch.tensor([tokens]))
    finally:
        for h in hooks:
            h.remove()
    return kept["last"], kept["second"]


def test_feature_proposer_gets_the_targets_hidden_states_of_accepted_positions(model, text):
    prompts = [text[0:21], text[300:313]]
    full = {tuple(p): greedy_reference(model, p, 16) for p in prompts}
    proposer = FeatureOracle(full, model.config.vocab_size)
    engine = Engine(model, proposer=proposer, num_speculative_tokens=3, block_size=4, max_num_seqs=2,
                    max_num_batched_tokens=16, chunked_prefill=True)
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(max_tokens=16), request_id=i)
    out = _drain(engine)
    assert [out[(i, 0)][0] for i in range(2)] == [full[tuple(p)] for p in prompts]
    assert any(len(f.positions) > 1 for _, f in proposer.seen)       # accepted drafts' positions too
    covered = {}
    for tokens, f in proposer.seen:
        n = len(f.positions)
        assert f.positions == list(range(f.positions[0], f.positions[0] + n)), "consecutive positions, in order"
        if len(tokens) > len(next(p for p in prompts if p == tokens[:len(p)])):   # once a token was sampled:
            assert f.positions[-1] == len(tokens) - 2, "up to the last final position"   # the newest ones
        last, second = full_forward_features(model, tokens)
        torch.testing.assert_close(f.last_hidden, last[f.positions], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(f.second_to_top, second[f.positions], rtol=1e-4, atol=1e-4)
        covered.setdefault(tuple(tokens[:5]), []).extend(f.positions)
    assert sum(len(tokens) == len(prompts[0]) for tokens, _ in proposer.seen) >= 1   # a chunk that left prompt
    for p in prompts:   # from position 0 on (chunk by chunk), each position handed over once, in order, with no
        got = covered[tuple(p[:5])]   # gap (a finished sequence gets none: nothing will draft for it)
        assert got == list(range(len(got))) and len(got) > len(p) + 8


def test_truncate_frees_only_the_tail_and_refuses_shared_blocks():
    manager = KVCacheManager(num_blocks=10, block_size=4)
    prompt = list(range(10))                           # 2 full blocks + 2 tokens
    manager.allocate("a", prompt)
    manager.cache_blocks("a", prompt)
    manager.fork("a", "b")                             # b shares all three blocks
    copies = manager.allocate_slots("b", 5)            # 2 + 5 = 7 slots past the full blocks: CoW + 1 new block
    shared = manager.tables["a"].blocks
    assert copies == [(shared[2], manager.tables["b"].blocks[2])] and len(manager.tables["b"].blocks) == 4
    counts = [manager.pool.ref_count(b) for b in shared]
    assert manager.truncate("b", 11) == 1              # the new block goes back; the copied block stays
    assert manager.tables["b"].num_tokens == 11 and len(manager.tables["b"].blocks) == 3
    assert [manager.pool.ref_count(b) for b in shared] == counts
    manager.check_invariants()
    with pytest.raises(ValueError, match="num_tokens"):
        manager.truncate("b", 4)                       # into the named prefix: refused
    manager.allocate_slots("a", 1)                     # a's last block is its own again (b copied)
    manager.fork("a", "c")
    manager.allocate_slots("c", 4)                     # CoW of a's last block + 1 new block for c
    with pytest.raises(ValueError, match="num_tokens"):
        manager.truncate("b", 12)                      # growing is not a rollback
    state = ([list(t.blocks) for t in manager.tables.values()], list(manager.pool.ref_counts))
    manager.fork("c", "d")                             # d and c share every block
    with pytest.raises(ValueError, match="shared or named"):
        manager.truncate("c", 12)
    manager.free("d")
    assert ([list(t.blocks) for t in manager.tables.values()], list(manager.pool.ref_counts)) == state
    manager.check_invariants()


def _tiny_pair():
    target = adapters.make_model(adapters.make_config(**TINY), seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(3)
    draft = copy.deepcopy(target)
    with torch.no_grad():   # a draft near the target: both acceptances and rejections, and a residual far from q
        for w in draft.parameters():
            w.add_(0.3 * torch.randn(w.shape, generator=torch.Generator().manual_seed(w.numel())))
    return target, draft


@pytest.mark.parametrize("kind", ["draft", "prompt_lookup", "medusa", "eagle"])
def test_sampled_engine_follows_the_target_chi_square(kind):
    # The joint law of the first 3 tokens (64 cells) over 1000 seeded requests served together by one
    # engine, against the target's full-forward probabilities. False-failure rate 1e-4. (Medusa, EAGLE:
    # seeded random heads, whose sampled drafts the target accepts and rejects on V = 4.)
    target, draft = _tiny_pair()
    prompt = [0, 1, 2, 0, 1] if kind == "prompt_lookup" else [3, 1]
    options = {"draft": dict(speculative="draft", draft_model=draft),
               "prompt_lookup": dict(speculative="prompt_lookup")}.get(
        kind, dict(speculative=kind, draft_model=random_heads(target, kind, seed=5)))
    engine = Engine(target, num_speculative_tokens=2, block_size=4, max_num_seqs=64, num_blocks=200, **options)
    runs = 1000
    for i in range(runs):
        # max_tokens 4: the first decode drafts 2 tokens (one stays for the bonus), so the first 3 tokens
        # come through acceptance, rejection + residual, or the bonus
        engine.add_request(prompt, SamplingParams(1.0, max_tokens=4, seed=1000 * i + 7), request_id=i)
    out = _drain(engine, limit=100_000)
    assert engine.scheduler.num_proposed > runs and 0 < engine.scheduler.num_accepted < engine.scheduler.num_proposed
    law = target_joint_law(target, prompt, 3)
    counts = dict.fromkeys(law, 0)
    for i in range(runs):
        counts[tuple(out[(i, 0)][0][:3])] += 1
    p = chi_square_p_value([counts[c] for c in law], [runs * law[c] for c in law])
    assert p > 1e-4, f"the engine's speculative samples do not follow the target (p = {p:.2e}, {kind})"
    assert engine.manager.num_free_blocks == engine.num_blocks


def test_drafting_stops_above_the_batch_size_limit(model, text):
    prompts = [text[0:20], text[100:120], text[200:220]]
    full = {tuple(p): greedy_reference(model, p, 10) for p in prompts}
    sizes = {}
    for limit in (2, 3):
        proposer = OracleProposer(full, model.config.vocab_size)
        engine = Engine(model, proposer=proposer, speculative_disable_by_batch_size=limit, block_size=4)
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_tokens=10), request_id=i)
        out = _drain(engine)
        assert [out[(i, 0)][0] for i in range(3)] == [full[tuple(p)] for p in prompts]
        sizes[limit] = proposer.calls
    assert sizes[2] == 0 < sizes[3]   # 3 running sequences: no drafting with a limit of 2


def test_bad_speculative_configs_raise(model):
    draft = load_pretrained("draft")
    tiny = adapters.make_model(adapters.make_config(**TINY))
    with pytest.raises(ValueError, match="speculative must be one of"):
        Engine(model, speculative="ngram")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Engine(model, speculative="prompt_lookup", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size"):
        Engine(model, speculative="prompt_lookup", speculative_disable_by_batch_size=0)
    with pytest.raises(ValueError, match="draft_model"):
        Engine(model, speculative="draft")
    with pytest.raises(ValueError, match="vocab"):
        Engine(model, speculative="draft", draft_model=tiny)
    with pytest.raises(ValueError, match="draft_model is used only"):
        Engine(model, draft_model=draft)
    with pytest.raises(ValueError, match="draft_model is used only"):
        Engine(model, speculative="prompt_lookup", draft_model=draft)
    with pytest.raises(TypeError, match="draft_model"):
        Engine(model, speculative="draft", draft_model="draft")
    with pytest.raises(ValueError, match="scheduler='static'"):
        Engine(model, speculative="prompt_lookup", scheduler="static")
    with pytest.raises(ValueError, match="kv_layout='contiguous'"):
        Engine(model, speculative="prompt_lookup", kv_layout="contiguous")
    with pytest.raises(TypeError, match="Proposer protocol"):
        Engine(model, proposer=object())
    with pytest.raises(ValueError, match="not both"):
        Engine(model, speculative="prompt_lookup", proposer=PromptLookupProposer())
    assert isinstance(PromptLookupProposer(), Proposer)


@pytest.mark.slow
def test_smollm2_prompt_lookup_in_the_engine_equals_the_plain_engine():
    from cs336_inference.data.real_text import prose_paragraphs
    from cs336_inference.model.real_models import real_model_missing
    from cs336_inference.model.tokenizer import load_tokenizer

    if missing := real_model_missing("smollm2-135m"):
        pytest.skip(missing)
    model, tok = load_pretrained("smollm2-135m").eval(), load_tokenizer("smollm2-135m")
    paragraphs = prose_paragraphs()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": task + paragraphs[1 + 5 * i]}]))
               for i, task in enumerate(("Rewrite the following passage:\n\n", "Summarize the following passage:\n\n",
                                         "Rewrite the following passage:\n\n"))]
    params = SamplingParams(max_tokens=40, stop_token_ids=tuple(tok.stop_ids))
    outputs, engine = plain_and_speculative_outputs(model, prompts, params, dict(speculative="prompt_lookup"),
                                                    max_num_seqs=3)
    assert outputs[1] == outputs[0]
    assert engine.scheduler.num_accepted > 20      # the answers copy the passage: many drafts kept
    assert outputs[0][0] == greedy_reference(model, prompts[0], 40, tuple(tok.stop_ids))
