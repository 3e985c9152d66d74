"""Speculative sampling's accept/resample rule and its theory, on explicit distributions (the library's own
tests, not graded: the rule is graded in tests/graded/test_speculative_accept.py, through the adapters).

Exactness is checked three ways: by enumerating every draft outcome in float64 (one step, and the
joint law of several tokens over chained steps), in exact fractions, and by sampling the rule
itself (chi-square, fixed seeds, false-failure rate < 1e-4 per test).
"""

import itertools
import math
from fractions import Fraction

import pytest
import torch
from adapters import (run_accept_rule, run_acceptance_probability, run_acceptance_rate, run_expected_speedup,
                      run_expected_tokens_per_pass, run_optimal_gamma, run_library_residual_distribution,
                      run_speculative_output_distribution)


def chi_square_p_value(counts, expected) -> float:
    """P[chi2 >= observed] with len - 1 degrees of freedom; cells expected < 5 are pooled."""
    counts, expected = torch.as_tensor(counts, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    small = expected < 5
    if small.any():
        counts = torch.cat([counts[~small], counts[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = float(((counts - expected) ** 2 / expected).sum())
    dof = len(counts) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def random_dist(V, generator, zeros=0, peaked=1.0):
    x = torch.rand(V, generator=generator, dtype=torch.float64) ** (1 + 3 * peaked)
    if zeros:
        x[torch.randperm(V, generator=generator)[:zeros]] = 0
    return x / x.sum()


def one_step_law(p, q):
    """The test's own sum over draft outcomes x ~ p: accepted with the rule's probability, else
    resampled from the rule's residual. Returns P[emitted token = y] for every y."""
    V = len(p)
    out = torch.zeros(V, dtype=torch.float64)
    residual = run_library_residual_distribution(p[None], q[None])[0]
    for x in range(V):
        if p[x] == 0:
            continue
        a = float(run_acceptance_probability(p[None], q[None], torch.tensor([x]))[0])
        out[x] += p[x] * a
        out += p[x] * (1 - a) * residual
    return out


@pytest.mark.parametrize("V", [2, 3, 5, 8])
def test_one_step_output_is_q_by_enumeration(V):
    g = torch.Generator().manual_seed(V)
    for trial in range(20):
        p = random_dist(V, g, zeros=trial % 2)
        q = random_dist(V, g, zeros=(trial // 2) % 2)
        torch.testing.assert_close(one_step_law(p, q), q, rtol=0, atol=1e-12)
    q = random_dist(V, g)
    torch.testing.assert_close(one_step_law(q.clone(), q), q, rtol=0, atol=1e-12)          # p == q
    p = torch.zeros(V, dtype=torch.float64)
    p[0] = 1
    q = torch.zeros(V, dtype=torch.float64)
    q[1:] = 1 / (V - 1)
    torch.testing.assert_close(one_step_law(p, q), q, rtol=0, atol=1e-12)                    # disjoint supports


def test_joint_law_of_several_tokens_by_enumeration():
    # Context-dependent p(.|prefix), q(.|prefix) over V = 3; gamma = 2. The law of the first 3
    # emitted tokens, summed over every draft outcome of chained steps, must be q's joint law.
    V, gamma, k = 3, 2, 3
    g = torch.Generator().manual_seed(7)
    p_table, q_table = {}, {}

    def p_at(prefix):
        return p_table.setdefault(prefix, random_dist(V, g, zeros=len(prefix) % 2))

    def q_at(prefix):
        return q_table.setdefault(prefix, random_dist(V, g))

    def first_tokens_law(prefix, n):
        """{tokens (n,) : probability} of the next n tokens emitted by steps starting at prefix."""
        if n == 0:
            return {(): 1.0}
        law = {}
        for drafts in itertools.product(range(V), repeat=gamma):  # every draft outcome and its probability
            prob = math.prod(float(p_at(prefix + drafts[:i])[x]) for i, x in enumerate(drafts))
            if prob == 0:
                continue
            reach = 1.0  # probability that the first i drafts were all accepted
            for i in range(gamma + 1):
                ctx = prefix + drafts[:i]
                if i == gamma:  # all accepted: bonus token from q
                    tails = [(drafts + (y,), reach * float(q_at(ctx)[y])) for y in range(V)]
                else:
                    p, q = p_at(ctx), q_at(ctx)
                    a = float(run_acceptance_probability(p[None], q[None], torch.tensor([drafts[i]]))[0])
                    r = run_library_residual_distribution(p[None], q[None])[0]
                    tails = [(drafts[:i] + (y,), reach * (1 - a) * float(r[y])) for y in range(V)]
                for block, w in tails:
                    if len(block) >= n:
                        key = block[:n]
                        law[key] = law.get(key, 0.0) + prob * w
                    else:  # the block is shorter than n: the next step continues from its end
                        for rest, w2 in first_tokens_law(prefix + block, n - len(block)).items():
                            law[block + rest] = law.get(block + rest, 0.0) + prob * w * w2
                if i < gamma:
                    reach *= a
        return law

    law = first_tokens_law((), k)
    for tokens in itertools.product(range(V), repeat=k):
        expected = math.prod(float(q_at(tokens[:i])[t]) for i, t in enumerate(tokens))
        assert law.get(tokens, 0.0) == pytest.approx(expected, abs=1e-12), tokens


def test_exact_fractions_two_token_proof():
    # The lecture's example: p(A) = 3/4 > q(A) = 1/2.
    d = run_speculative_output_distribution(["3/4", "1/4"], ["1/2", "1/2"])
    assert d["accepted"] == [Fraction(1, 2), Fraction(1, 4)]   # p(A) * q(A)/p(A), p(B) * 1
    assert d["reject"] == Fraction(1, 4)                       # p(A) (1 - q(A)/p(A))
    assert d["residual"] == [0, 1]                             # all of the excess is on B
    assert d["output"] == [Fraction(1, 2), Fraction(1, 2)]


def test_exact_fractions_any_p_q():
    g = torch.Generator().manual_seed(3)
    for V in (2, 3, 4, 7):
        for _ in range(10):
            dists = []
            for _ in range(2):
                w = [int(x) for x in torch.randint(0, 9, (V,), generator=g)]
                w[0] += 1  # never all zero
                dists.append([Fraction(x, sum(w)) for x in w])
            p, q = dists
            d = run_speculative_output_distribution(p, q)
            assert d["output"] == q
            assert 1 - d["reject"] == sum(min(a, b) for a, b in zip(p, q))


def test_accept_rule_by_sampling_first_token_and_acceptance_counts():
    # Fixed p_i, q_i over V = 5 at gamma = 3 positions. The emitted token at the first rejection or
    # the bonus must follow q at that position, and the number accepted is a product of the
    # per-position acceptance probabilities alpha_i = sum min(p_i, q_i).
    V, gamma, N = 5, 3, 6000
    g = torch.Generator().manual_seed(11)
    p = torch.stack([random_dist(V, g) for _ in range(gamma)]).float()
    q = torch.stack([random_dist(V, g) for _ in range(gamma + 1)]).float()
    rng = torch.Generator().manual_seed(12)
    drafts = torch.multinomial(p, N, replacement=True, generator=rng).T          # (N, gamma): x_i ~ p_i
    first_token = torch.zeros(V)
    accepted = torch.zeros(gamma + 1)
    for n in range(N):
        k, token = run_accept_rule(p, q, drafts[n], generator=rng)
        accepted[k] += 1
        first_token[(drafts[n][0] if k > 0 else token)] += 1
    assert chi_square_p_value(first_token, N * q[0].double()) > 1e-4
    alpha = torch.minimum(p, q[:gamma]).sum(-1).double()                          # (gamma,)
    reach = torch.cat([torch.ones(1, dtype=torch.float64), torch.cumprod(alpha, 0)])
    law = reach * torch.cat([1 - alpha, torch.ones(1, dtype=torch.float64)])     # P[k accepted]
    assert chi_square_p_value(accepted, N * law) > 1e-4


def test_accept_rule_greedy_is_argmax_verification():
    V = 6
    q_logits = torch.randn(4, V)
    q = torch.nn.functional.one_hot(q_logits.argmax(-1), V).float()
    best = q_logits.argmax(-1)
    for drafts, expected_k in [(best[:3], 3), (torch.tensor([best[0], (best[1] + 1) % V, best[2]]), 1),
                               (torch.tensor([(best[0] + 1) % V, best[1], best[2]]), 0)]:
        p = torch.nn.functional.one_hot(drafts, V).float()
        for seed in range(5):
            k, token = run_accept_rule(p, q, drafts, generator=torch.Generator().manual_seed(seed))
            assert (k, token) == (expected_k, int(best[expected_k]))


def test_expected_tokens_per_pass_and_speedup():
    for alpha in (0.0, 0.3, 0.8, 0.99):
        for gamma in range(0, 9):
            geometric = sum(alpha ** i for i in range(gamma + 1))  # 1 + alpha + ... + alpha^gamma
            assert run_expected_tokens_per_pass(alpha, gamma) == pytest.approx(geometric)
            assert run_expected_speedup(alpha, gamma, 0.1) == pytest.approx(geometric / (0.1 * gamma + 1))
            assert run_expected_speedup(alpha, gamma, 0.1, verify_cost=2) == pytest.approx(
                geometric / (0.1 * gamma + 2))
    assert run_expected_tokens_per_pass(1.0, 4) == 5
    assert run_expected_tokens_per_pass(Fraction(1, 2), 2) == Fraction(7, 4)
    # Leviathan et al. figure: alpha 0.8, c 0.05 -> the best gamma, by brute force here.
    for alpha, c in [(0.8, 0.05), (0.6, 0.2), (0.95, 0.01), (0.2, 0.5)]:
        speed = {g: sum(alpha ** i for i in range(g + 1)) / (g * c + 1) for g in range(1, 65)}
        best = max(speed, key=lambda g: (speed[g], -g))
        assert run_optimal_gamma(alpha, c) == best


def test_acceptance_rate_is_one_minus_total_variation():
    g = torch.Generator().manual_seed(0)
    p, q = random_dist(7, g), random_dist(7, g)
    tv = 0.5 * float((p - q).abs().sum())
    assert float(run_acceptance_rate(p, q)) == pytest.approx(1 - tv)
    assert run_acceptance_rate(["1/2", "1/2"], ["1/4", "3/4"]) == Fraction(3, 4)


def _accept(p_shape, q_shape, tokens):
    return lambda: run_accept_rule(torch.rand(*p_shape), torch.rand(*q_shape), torch.tensor(tokens))


@pytest.mark.parametrize("call, error, match", [
    (_accept((2, 5), (3, 6), [0, 1]), ValueError, "vocab"),
    (_accept((2, 5), (2, 5), [0, 1]), ValueError, "g \\+ 1"),
    (_accept((2, 5), (3, 5), [0]), ValueError, "draft_tokens"),
    (_accept((2, 5), (3, 5), [0, 5]), ValueError, "draft_tokens"),
    (_accept((2, 5), (3, 5), [0.0, 1.0]), TypeError, "draft_tokens"),
    (lambda: run_accept_rule([[0.5, 0.5]], torch.rand(2, 2), torch.tensor([0])), TypeError, "p_draft"),
    (lambda: run_expected_tokens_per_pass(1.5, 3), ValueError, "alpha"),
    (lambda: run_expected_tokens_per_pass(0.5, -1), ValueError, "gamma"),
    (lambda: run_expected_speedup(0.5, 3, -0.1), ValueError, "cost_ratio"),
    (lambda: run_optimal_gamma(0.5, 0.1, max_gamma=0), ValueError, "gamma"),
    (lambda: run_speculative_output_distribution(["1/2", "1/3"], ["1/2", "1/2"]), ValueError, "sum to exactly 1"),
    (lambda: run_speculative_output_distribution(["1/2", "1/2"], ["1/3", "1/3", "1/3"]), ValueError, "same vocabulary"),
    (lambda: run_speculative_output_distribution(["3/2", "-1/2"], ["1/2", "1/2"]), ValueError, "non-negative"),
])
def test_bad_inputs_to_rule_and_theory(call, error, match):
    with pytest.raises(error, match=match):
        call()
