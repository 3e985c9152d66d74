"""Graded: speculative sampling's accept/resample rule (speculative_accept). The reference is an exact
enumeration written here in fractions. For fixed draft tokens x_1..x_g, with a_i = min(1, q_i(x_i) / p_i(x_i))
and the residual r_i = norm(max(q_i - p_i, 0)):
    P(k accepted, next = y) = a_1 ... a_k (1 - a_{k+1}) r_{k+1}(y)   for k < g,
                             a_1 ... a_g q_{g+1}(y)                   for k = g,
and with x_i drawn from p_i the first emitted token is distributed exactly as q_1 (checked in fractions
here, then on the student's draws). Probabilities are multiples of 1/16, exact in float32 and as fractions.
Draws are chi-square tested at p = 1e-4 with fixed seeds (deterministic; a correct rule fails with
probability below 1e-4 per test)."""

from fractions import Fraction

import pytest
import torch
from adapters import each, run_greedy_verify, run_residual_distribution, run_speculative_accept

# chi-square critical values at p = 1e-4 by degrees of freedom
CHI2_1E4 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88, 8: 31.83, 9: 33.72, 10: 35.56,
            11: 37.37, 12: 39.13}

# g = 2 proposed tokens over V = 4; sixteenths, so float32 holds them exactly
P = [[8, 4, 2, 2], [2, 2, 4, 8]]                   # the draft's distributions at the two proposed positions
Q = [[4, 4, 4, 4], [8, 2, 2, 4], [2, 6, 4, 4]]     # the target's, plus the bonus position
V = 4


def _fractions(rows):
    return [[Fraction(x, 16) for x in row] for row in rows]


def _tensor(rows):
    return torch.tensor(rows, dtype=torch.float32) / 16


def exact_outcomes(p, q, x) -> dict[tuple[int, int], Fraction]:
    """{(k, y): probability} for fixed draft tokens x, by the rule's definition (fractions)."""
    g, out, alive = len(x), {}, Fraction(1)
    for i in range(g):
        px, qx = p[i][x[i]], q[i][x[i]]
        a = min(Fraction(1), qx / px) if px > 0 else Fraction(int(qx > 0))
        residual = [max(qy - py, Fraction(0)) for qy, py in zip(q[i], p[i])]
        mass = sum(residual)
        for y in range(len(q[i])):
            if mass > 0 and residual[y] > 0:
                out[(i, y)] = alive * (1 - a) * residual[y] / mass
        alive *= a
    for y, qy in enumerate(q[g]):
        if qy > 0:
            out[(g, y)] = alive * qy
    return out


def _draw(p, q, x, n, seed):
    """n calls of the student's rule with fixed draft tokens -> {(k, y): count}."""
    g = torch.Generator().manual_seed(seed)
    p_t, q_t, x_t = _tensor(p), _tensor(q), torch.tensor(x)
    counts: dict[tuple[int, int], int] = {}
    for k, y in each(run_speculative_accept, [(p_t, q_t, x_t, g)] * n):
        counts[(int(k), int(y))] = counts.get((int(k), int(y)), 0) + 1
    return counts


def _chi_square(counts, probs, n):
    unexpected = {o: c for o, c in counts.items() if probs.get(o, 0) == 0}
    assert not unexpected, f"outcomes (num_accepted, next_token) that cannot happen: {unexpected}"
    return sum((counts.get(o, 0) - n * float(w)) ** 2 / (n * float(w)) for o, w in probs.items() if w > 0)


@pytest.mark.parametrize("x", [[0, 3], [1, 0], [2, 2], [3, 1]], ids=str)
def test_outcomes_for_fixed_drafts_match_the_exact_enumeration(x):
    n = 4000
    probs = exact_outcomes(_fractions(P), _fractions(Q), x)
    counts = _draw(P, Q, x, n, seed=sum(x) * 7 + x[0])
    dof = sum(1 for w in probs.values() if w > 0) - 1
    chi2 = _chi_square(counts, probs, n)
    assert chi2 < CHI2_1E4[dof], f"x={x}: chi-square {chi2:.1f} (dof {dof}); counts {counts}, want {probs}"


def test_the_first_emitted_token_follows_the_target():
    """Draft tokens drawn from p (here, by the test, with a generator of their own), then the rule: the first token
    it emits is a sample of q_1."""
    # the enumeration itself, checked exactly: summed over draft tokens x ~ p, the first emitted token ~ q_1
    p, q = _fractions(P), _fractions(Q)
    first = [Fraction(0)] * V
    for x1 in range(V):
        for x2 in range(V):
            for (k, y), w in exact_outcomes(p, q, [x1, x2]).items():
                first[x1 if k >= 1 else y] += p[0][x1] * p[1][x2] * w
    assert first == q[0]
    n, g = 6000, torch.Generator().manual_seed(11)
    p_t, q_t = _tensor(P), _tensor(Q)
    drafts = torch.multinomial(p_t, n, replacement=True, generator=torch.Generator().manual_seed(12)).T.contiguous()
    counts = [0] * V
    for x, (k, y) in zip(drafts, each(run_speculative_accept, [(p_t, q_t, x, g) for x in drafts])):
        counts[int(x[0]) if int(k) >= 1 else int(y)] += 1
    q1 = [w / 16 for w in Q[0]]
    chi2 = sum((c - n * w) ** 2 / (n * w) for c, w in zip(counts, q1))
    assert chi2 < CHI2_1E4[V - 1], f"first tokens {counts} vs q_1 {q1}"


def test_cases_without_randomness():
    """Where the rule's outcome is certain: a target that agrees with the draft, a token the target forbids,
    one-hot distributions (temperature 0: greedy verification), nothing proposed."""
    p, x = _tensor(P), torch.tensor([1, 3])
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        k, _ = run_speculative_accept(p, torch.cat([p, _tensor([Q[2]])]), x, generator=g)
        assert int(k) == 2, "the target agrees with the draft everywhere: every draft token is accepted"
        q0 = _tensor([[0, 8, 8, 0], Q[1], Q[2]])           # the target never emits token 3 at the first position
        k, y = run_speculative_accept(p, q0, torch.tensor([3, 0]), generator=g)
        assert (int(k), int(y)) in {(0, 1), (0, 2)}, "a token the target forbids is rejected, the residual resamples"
    one_hot = torch.eye(V)
    for draft, want in [([2, 1], (2, 3)), ([2, 0], (1, 1)), ([0, 1], (0, 2))]:   # temperature 0: greedy verification
        k, y = run_speculative_accept(one_hot[draft], one_hot[[2, 1, 3]], torch.tensor(draft),
                                      generator=torch.Generator().manual_seed(0))
        assert (int(k), int(y)) == want, f"one-hot draft {draft} against target argmaxes [2, 1, 3]"
    k, y = run_speculative_accept(torch.zeros(0, V), one_hot[[2]], torch.zeros(0, dtype=torch.long))
    assert (int(k), int(y)) == (0, 2), "nothing proposed: the token comes from q_1"


def test_a_token_neither_model_allows_is_never_accepted():
    """p_i(x_i) = 0: accept iff q_i(x_i) > 0 (0/0 must not count as a ratio >= 1)."""
    p = _tensor([[8, 8, 0, 0], [4, 4, 4, 4]])
    for seed in range(30):
        g = torch.Generator().manual_seed(seed)
        k, y = run_speculative_accept(p, _tensor([[8, 8, 0, 0], Q[1], Q[2]]), torch.tensor([3, 0]), generator=g)
        assert int(k) == 0 and int(y) in (0, 1), "token 3 has p = q = 0 at the first position: it must be rejected"
        k, _ = run_speculative_accept(p, _tensor([[4, 4, 4, 4], [4, 4, 4, 4], Q[2]]), torch.tensor([2, 1]),
                                      generator=g)
        assert int(k) >= 1, "p = 0 < q: the draft token is accepted"


def test_every_draw_comes_from_the_generator_argument():
    """Same generator seed: same outcomes, whatever the global RNG holds; the global RNG is left untouched."""
    p_t, q_t, x_t = _tensor(P), _tensor(Q), torch.tensor([1, 0])
    runs = []
    for global_seed in (1, 2):
        torch.manual_seed(global_seed)
        state = torch.get_rng_state()
        g = torch.Generator().manual_seed(5)
        runs.append([tuple(map(int, run_speculative_accept(p_t, q_t, x_t, generator=g))) for _ in range(60)])
        assert torch.equal(torch.get_rng_state(), state), "the global RNG was used (draw from `generator`)"
    assert runs[0] == runs[1], "the outcomes depend on the global RNG, not only on the generator argument"
    assert len(set(runs[0])) > 1


def test_the_residual_is_the_normalised_positive_part_of_q_minus_p():
    p, q = _fractions(P), _fractions(Q[:2])
    got = run_residual_distribution(_tensor(P), _tensor(Q[:2]))
    assert got.shape == (2, V)
    for i in range(2):
        positive = [max(qy - py, Fraction(0)) for qy, py in zip(q[i], p[i])]
        want = [float(r / sum(positive)) for r in positive]
        torch.testing.assert_close(got[i].double(), torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=0)
    same = run_residual_distribution(_tensor([Q[1]]), _tensor([Q[1]]))       # q == p: no mass left, q itself
    torch.testing.assert_close(same.double(), _tensor([Q[1]]).double(), atol=1e-7, rtol=0)
    batch = torch.softmax(torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(0)), -1)
    other = torch.softmax(torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(1)), -1)
    r = run_residual_distribution(batch, other)
    assert r.shape == (2, 3, 7) and float((r.sum(-1) - 1).abs().max()) < 1e-5 and float(r.min()) >= 0


def test_greedy_verification_keeps_drafts_while_they_are_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0.5], [2.0, 0.0, 2.0, 1.0], [0.0, 0.0, 0.0, 5.0], [1.0, 4.0, 0.0, 0.0]])
    argmax = [1, 0, 3, 1]                                  # row 1 ties 0 and 2: the lowest id wins
    for draft, want in [([1, 0, 3], (3, 1)), ([1, 0, 2], (2, 3)), ([1, 2, 3], (1, 0)), ([0, 0, 3], (0, 1)),
                        ([1, 0], (2, 3)), ([], (0, 1))]:
        got = run_greedy_verify(draft, logits[:len(draft) + 1])
        assert tuple(map(int, got)) == want, f"draft {draft} against argmaxes {argmax[:len(draft) + 1]}: {got}"
