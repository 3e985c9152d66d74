"""The draft-verify-rollback loop on real models: greedy output equals the target's, caches after
rollback equal caches built from the accepted tokens, sampled output follows the target's law
(chi-square, fixed seed, false-failure rate < 1e-4 per comparison), acceptance statistics match the
theory for a draft whose distance to the target is known, prompt lookup, and bad inputs."""

import copy
import itertools

import pytest
import torch
from adapters import (get_drafter_protocol, make_config, make_model, make_prompt_lookup_drafter, make_sampling_params,
                      make_speculative_decoder, run_generate, run_model, run_prompt_lookup_propose,
                      run_speculative_generate)
from cs336_inference.model import load_pretrained
from test_speculative_rule import chi_square_p_value

TINY = dict(vocab_size=4, context_length=16, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1, d_ff=32)


@pytest.fixture(scope="module")
def shipped():
    return {name: load_pretrained(name) for name in ("target", "draft", "draft-scratch")}


def tiny_pair(kind: str):
    """A tiny random target with peaked, context-dependent distributions, and a draft that is good
    (the target with perturbed weights) or deliberately bad (prefers what the target avoids)."""
    target = make_model(make_config(**TINY), seed=0)
    with torch.no_grad():
        target.lm_head.weight.mul_(3)
    draft = copy.deepcopy(target)
    with torch.no_grad():
        if kind == "good":
            for w in draft.parameters():
                w.add_(0.3 * torch.randn_like(w))
        else:
            draft.lm_head.weight.mul_(-1)
    return target, draft


@torch.no_grad()
def target_joint_law(target, prompt, k, temperature=1.0, top_k=None):
    """P[first k tokens = t] for every t, from the target's full-forward probabilities (written here,
    independently of the library's sampling code)."""
    V = target.config.vocab_size
    law = {}
    for tokens in itertools.product(range(V), repeat=k):
        logits = run_model(target, torch.tensor([prompt + list(tokens)]))[0, len(prompt) - 1:].double() / temperature
        if top_k is not None:
            kth = logits.sort(-1, descending=True).values[:, top_k - 1:top_k]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, -1)
        law[tokens] = float(torch.prod(torch.stack([probs[i, t] for i, t in enumerate(tokens)])))
    return law


def sampled_law_p_value(target, draft, prompt, k, gamma, runs, seed, **kwargs):
    law = target_joint_law(target, prompt, k, kwargs.get("temperature", 1.0), kwargs.get("top_k"))
    cells = list(law)
    counts = dict.fromkeys(cells, 0)
    g = torch.Generator().manual_seed(seed)
    for _ in range(runs):
        out = run_speculative_generate(target, draft, prompt, gamma, max_new_tokens=k, generator=g, **kwargs)
        counts[tuple(out.tokens)] += 1
    return chi_square_p_value([counts[c] for c in cells], [runs * law[c] for c in cells])


def greedy_acceptance(propose, prompt, expected, gamma):
    """Per pass: (drafts proposed, drafts accepted) when the output is `expected` and `propose(seq, n)`
    gives the drafter's greedy guesses: accepted = how many leading guesses match `expected`."""
    pos, passes = 1, []  # the first token comes from the target's prefill
    while pos < len(expected):
        n = min(gamma, len(expected) - pos - 1)
        guesses = propose(prompt + expected[:pos], n)  # prompt lookup may find fewer than n
        k = 0
        while k < len(guesses) and guesses[k] == expected[pos + k]:
            k += 1
        passes.append((len(guesses), k))
        pos += k + 1
    return passes


@pytest.mark.parametrize("gamma", [1, 3, 5, 8])
def test_greedy_output_equals_target_greedy(shipped, one_thread, gamma):
    target = shipped["target"]
    prompt = list(b"Once upon a time in Ashford, ")
    expected = run_generate(target, [prompt], 40).tokens[0]
    proposers = {
        "draft": lambda seq, n: run_generate(shipped["draft"], [seq], n).tokens[0] if n else [],
        "draft-scratch": lambda seq, n: run_generate(shipped["draft-scratch"], [seq], n).tokens[0] if n else [],
        "prompt_lookup": run_prompt_lookup_propose,
    }
    for name, propose in proposers.items():
        draft = name if name == "prompt_lookup" else shipped[name]
        out = run_speculative_generate(target, draft, prompt, gamma, max_new_tokens=40)
        assert out.tokens == expected, (name, gamma)
        passes = greedy_acceptance(propose, prompt, expected, gamma)
        assert list(zip(out.proposed, out.accepted)) == passes, (name, gamma)
        assert out.target_forwards == len(passes)
    assert sum(k for _, k in passes) > 0  # prompt lookup found something to copy


@pytest.mark.parametrize("gamma", [2, 5])
def test_greedy_with_a_sliding_window_target(one_thread, gamma):
    # Rolling caches must roll back gamma + 1 positions after the ring has wrapped: the decoder asks
    # for that room (max_rollback), and the output still equals the target's greedy output.
    config = make_config(**{**TINY, "vocab_size": 6, "context_length": 64, "sliding_window": 5})
    target, draft = make_model(config, seed=0), make_model(config, seed=1)
    with torch.no_grad():
        target.lm_head.weight.mul_(3)
    prompt = [1, 2, 3, 4, 5, 0, 1, 2]
    expected = run_generate(target, [prompt], 40).tokens[0]
    for drafter in (draft, "prompt_lookup"):
        out = run_speculative_generate(target, drafter, prompt, gamma, max_new_tokens=40)
        assert out.tokens == expected
        assert any(k < g for g, k in zip(out.proposed, out.accepted))  # rollbacks happened


def test_top_k_1_sampling_is_greedy(shipped, one_thread):
    # top_k = 1 at temperature 1 leaves one token with probability 1: sampling must equal greedy.
    target, draft = shipped["target"], shipped["draft"]
    prompt = list(b"The miller said ")
    expected = run_generate(target, [prompt], 24).tokens[0]
    out = run_speculative_generate(target, draft, prompt, 4, temperature=1.0, top_k=1, max_new_tokens=24,
                                   generator=torch.Generator().manual_seed(0))
    assert out.tokens == expected


@torch.inference_mode()
def test_model_drafter_samples_from_the_filtered_distribution_it_reports(shipped, one_thread):
    # The rule is exact only if p is the distribution the drafts were drawn from (filters included).
    draft = shipped["draft"]
    dec = make_speculative_decoder(shipped["target"], draft, list(b"The cook "), 3, 0.8, top_k=2, max_new_tokens=20)
    seq = dec.sequence
    tokens, probs = dec.drafter.propose(seq, 3, make_sampling_params(0.8, top_k=2), torch.Generator().manual_seed(0))
    assert len(tokens) == 3 and probs.shape == (3, 257)
    for i, t in enumerate(tokens):
        logits = run_model(draft, torch.tensor([seq + tokens[:i]]))[0, -1].double() / 0.8
        top2 = logits.topk(2).indices
        expected = torch.zeros(257, dtype=torch.float64)
        expected[top2] = torch.softmax(logits[top2], -1)
        torch.testing.assert_close(probs[i].double(), expected, rtol=1e-4, atol=1e-5)
        assert t in top2.tolist()


def _cache_tensors(cache, n):
    """Keys/values (or latents) of the first n positions of every distinct layer cache."""
    out = []
    for layer in cache.unique_layers():
        read = layer.read(n)
        out.extend(read if isinstance(read, tuple) else [read])
    return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@torch.inference_mode()  # the decoder's caches are inference tensors
def test_caches_after_rollback_equal_caches_of_accepted_tokens(shipped, one_thread, temperature):
    target, draft = shipped["target"], shipped["draft-scratch"]  # the weaker draft: more rejections
    dec = make_speculative_decoder(target, draft, list(b"By dawn the price of "), 4, temperature,
                                   max_new_tokens=40, generator=torch.Generator().manual_seed(1))
    rejections = 0
    while not dec.finished:
        dec.step()
        rejections += dec.result.accepted[-1] < dec.result.proposed[-1]
        seq = dec.sequence
        for model, cache in ((target, dec.target_cache), (draft, dec.drafter.cache)):
            n = cache.length
            assert n <= len(seq) - 1 and (model is draft or n == len(seq) - 1)
            fresh = model.new_cache(1, cache.max_seq_len)
            run_model(model, torch.tensor([seq[:n]]), fresh)
            for got, want in zip(_cache_tensors(cache, n), _cache_tensors(fresh, n), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        # and the rolled-back target cache predicts the next token as a full forward does
        probe = dec.target_cache
        nxt = run_model(target, torch.tensor([seq[-1:]]), probe)[0, -1]
        probe.truncate(probe.length - 1)
        torch.testing.assert_close(nxt, run_model(target, torch.tensor([seq]))[0, -1], rtol=1e-4, atol=1e-4)
    assert rejections > 0, "no draft was ever rejected: this test did not exercise rollback"


def test_sampled_tokens_follow_the_target_chi_square(one_thread):
    # Joint law of the first 3 tokens (64 cells) over 1000 runs at gamma = 2 with the bad draft: tokens
    # 2-3 come from one pass through acceptance, rejection + residual, or bonus. False-failure rate
    # 1e-4. The slow variants below add the good draft, top-k, prompt lookup and more samples.
    target, draft = tiny_pair("bad")
    p = sampled_law_p_value(target, draft, [0, 1, 2], k=3, gamma=2, runs=1000, seed=6, temperature=1.0)
    assert p > 1e-4, f"speculative samples do not follow the target (p = {p:.2e}, bad draft)"


@pytest.mark.slow
@pytest.mark.parametrize("kind, gamma, k, kwargs", [
    ("good", 3, 4, dict(temperature=1.0)),            # mostly accepted: the bonus-token path
    ("bad", 1, 3, dict(temperature=0.7, top_k=3)),    # filtering applied to both models
    ("lookup", 2, 3, dict(temperature=1.0)),          # one-hot drafts from prompt lookup
])
def test_sampled_tokens_follow_the_target_chi_square_slow(one_thread, kind, gamma, k, kwargs):
    target, draft = tiny_pair("bad" if kind == "lookup" else kind)
    draft = make_prompt_lookup_drafter(max_ngram=2) if kind == "lookup" else draft
    prompt = [0, 1, 2, 0, 1] if kind == "lookup" else [3, 1]
    p = sampled_law_p_value(target, draft, prompt, k=k, gamma=gamma, runs=3000, seed=21, **kwargs)
    assert p > 1e-4, f"speculative samples do not follow the target (p = {p:.2e}, {kind}, {kwargs})"


class NoisyTargetDrafter:
    """Draft distribution p = (1 - eps) q + eps * uniform, built from the target's own full forward,
    so alpha = sum min(p, q) is known exactly at every drafted position (recorded in `alphas`)."""

    def __init__(self, target, eps):
        self.target, self.eps, self.forwards, self.alphas = target, eps, 0, []

    def start(self, prompt, max_seq_len, max_rollback=1):
        pass

    @torch.inference_mode()
    def propose(self, sequence, n, sampling, generator=None):
        tokens, probs, alphas = [], [], []
        for _ in range(n):
            q = torch.softmax(run_model(self.target, torch.tensor([sequence + tokens]))[0, -1].double(), -1)
            p = (1 - self.eps) * q + self.eps / len(q)
            alphas.append(float(torch.minimum(p, q).sum()))
            tokens.append(int(torch.multinomial(p, 1, generator=generator)))
            probs.append(p.float())
            self.forwards += 1
        self.alphas.append(alphas)
        return tokens, (torch.stack(probs) if probs else None)

    def rollback(self, length):
        pass


def test_acceptance_statistics_match_theory_for_a_known_draft(shipped, one_thread):
    # Every examined draft token is accepted with probability alpha_i = sum min(p_i, q_i), computed here
    # from the target's probabilities. Total accepted vs sum of alpha_i: |z| < 4.4 (p ~ 1e-5).
    target = shipped["target"]
    drafter = NoisyTargetDrafter(target, eps=0.5)
    assert isinstance(drafter, get_drafter_protocol())
    out = run_speculative_generate(target, drafter, list(b"On Sunday "), 4, temperature=1.0, max_new_tokens=100,
                                   generator=torch.Generator().manual_seed(3))
    mean = var = 0.0
    for alphas, k in zip(drafter.alphas, out.accepted, strict=True):
        for a in alphas[:min(k + 1, len(alphas))]:  # examined: the accepted ones and the first rejected
            mean, var = mean + a, var + a * (1 - a)
    z = (sum(out.accepted) - mean) / var ** 0.5
    assert abs(z) < 4.4, f"accepted {sum(out.accepted)} draft tokens, theory says {mean:.1f} +- {var ** 0.5:.1f}"
    examined = sum(min(k + 1, len(a)) for a, k in zip(drafter.alphas, out.accepted))
    assert out.alpha == pytest.approx(sum(out.accepted) / examined)


def test_prompt_lookup_propose_against_a_naive_search():
    assert run_prompt_lookup_propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert run_prompt_lookup_propose([5, 6, 7], 2) == []                       # nothing repeats
    assert run_prompt_lookup_propose([1, 2, 9, 1, 2, 8, 2], 2, max_ngram=2) == [8, 2]  # most recent 1-gram "2"
    g = torch.Generator().manual_seed(0)
    for i in range(600):
        seq = torch.randint(0, 4, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        n = int(torch.randint(0, 5, (1,), generator=g))
        longest, shortest = [(3, 1), (4, 2), (2, 2)][i % 3]
        expected = []
        for size in range(min(longest, len(seq) - 1), shortest - 1, -1):  # longest suffix n-gram seen before
            hits = [i for i in range(len(seq) - size) if seq[i:i + size] == seq[-size:]]
            if hits:                                                         # its latest copy
                expected = seq[hits[-1] + size:hits[-1] + size + n]
                break
        expected = expected if n > 0 else []
        assert run_prompt_lookup_propose(seq, n, max_ngram=longest, min_ngram=shortest) == expected, (seq, n)
        drafter = make_prompt_lookup_drafter(max_ngram=longest, min_ngram=shortest)   # what the loop calls
        assert drafter.propose(seq, n, make_sampling_params()) == (expected, None), (seq, n)


def test_statistics_are_consistent(shipped, one_thread):
    out = run_speculative_generate(shipped["target"], shipped["draft"], list(b"There they met "), 3,
                                   max_new_tokens=50)
    assert len(out.tokens) == 50 and out.finish_reason == "length"
    assert out.draft_forwards == sum(out.proposed)                 # one draft forward per drafted token
    assert all(0 <= k <= g <= 3 for g, k in zip(out.proposed, out.accepted))
    assert out.mean_tokens_per_pass == pytest.approx(49 / out.target_forwards)
    assert 0 < out.draft_time_s and 0 < out.target_time_s and out.draft_time_s + out.target_time_s < out.total_time_s
    stop = out.tokens[10]
    stopped = run_speculative_generate(shipped["target"], shipped["draft"], list(b"There they met "), 3,
                                       max_new_tokens=50, stop_tokens=[stop])
    first = out.tokens.index(stop)
    assert stopped.tokens == out.tokens[:first + 1] and stopped.finish_reason == "stop"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_passes_without_drafts_run_the_decode_step(shipped, one_thread, temperature):
    # The loop hands every pass whose drafter found nothing (and only those) to `decode_step`, and the
    # output is the same tokens as the loop without it (same seed), which equal the target's greedy ones.
    target, calls = shipped["target"], []

    def step(token_ids, cache):   # the eager one-token forward, counted
        calls.append(int(token_ids.shape[0]))
        return target(token_ids[:, None], cache=cache)[:, -1]

    prompt = list(b"the cat and the dog and the cat and the ")
    runs = [run_speculative_generate(target, make_prompt_lookup_drafter(max_ngram=3, min_ngram=2), prompt, 4,
                                     temperature, max_new_tokens=40, generator=torch.Generator().manual_seed(3),
                                     decode_step=d)
            for d in (None, step)]
    assert runs[1].tokens == runs[0].tokens
    if temperature == 0.0:
        assert runs[0].tokens == run_generate(target, [prompt], 40).tokens[0]
    draftless = sum(1 for g in runs[1].proposed if g == 0)
    assert 0 < draftless < len(runs[1].proposed) and calls == [1] * draftless
    with pytest.raises(TypeError, match="decode_step"):
        run_speculative_generate(target, "prompt_lookup", prompt, 4, max_new_tokens=4, decode_step="compiled")


def test_bad_inputs(shipped):
    target, draft = shipped["target"], shipped["draft"]
    other_vocab = make_model(make_config(**{**TINY, "vocab_size": 300, "context_length": 512}))
    prompt = [1, 2, 3]
    cases = [
        (dict(gamma=0), ValueError, "gamma"), (dict(gamma=-2), ValueError, "gamma"),
        (dict(gamma=2.0), TypeError, "gamma"), (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(top_p=0.0), ValueError, "top_p"), (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
        (dict(draft=other_vocab), ValueError, "vocab"), (dict(draft=3), TypeError, "draft"),
        (dict(prompt_ids=[[1, 2], [3, 4]]), ValueError, "one sequence"),
        (dict(prompt_ids=[1, 999]), ValueError, "vocab_size"),
        (dict(max_new_tokens=600), ValueError, "context_length"),
    ]
    for overrides, error, match in cases:
        args = dict(draft=draft, prompt_ids=prompt, gamma=2, temperature=0.0) | overrides
        with pytest.raises(error, match=match):
            run_speculative_generate(target, args.pop("draft"), args.pop("prompt_ids"), args.pop("gamma"),
                                     args.pop("temperature"), **args)
    with pytest.raises(ValueError, match="min_ngram"):
        make_prompt_lookup_drafter(max_ngram=1, min_ngram=2)
