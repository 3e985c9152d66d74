# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Speculative sampling: worked answers
#
# The exercises of `../05_speculative_sampling.ipynb`, answered step by step. Try them first; each answer
# here is checked against an independent computation by `tests/library/test_notebook_exercises.py`.

# %%
from fractions import Fraction

from cs336_inference.generation import expected_tokens_per_pass, optimal_gamma, speculative_output_distribution

# %% [markdown]
# ## Exercise 1: alpha = 0.5 with all of the residual on one token
# The acceptance rate is alpha = sum_x min(p(x), q(x)), and the residual is norm(max(q - p, 0)). For the
# residual to sit on one token, q may exceed p on that token only. Let the target want tokens 0 and 1
# equally, and let the draft never propose 0 and waste half its mass on token 2, which q never picks.

# %%
q = (Fraction(1, 2), Fraction(1, 2), Fraction(0))
p = (Fraction(0), Fraction(1, 2), Fraction(1, 2))
d = speculative_output_distribution(p, q)
alpha = sum(d.accepted)
print(f"alpha = {alpha}; residual {[str(r) for r in d.residual]}; output {[str(o) for o in d.output]} = q")

# %% [markdown]
# The draft proposes token 2 half the time, and q(2) = 0 rejects every one of them; it proposes token 1
# half the time, always accepted (q(1) = p(1)). Every rejection is replaced by a sample from the
# residual, here all on token 0, the one the draft never proposes. The output is still exactly q: a bad
# draft only costs passes.
#
# ## Exercise 2: when is one draft token best?
# Per target pass, gamma drafts emit E(gamma) = (1 - alpha^(gamma+1)) / (1 - alpha) tokens at a cost of
# gamma c + v (v: a verification pass in decode steps). gamma = 1 beats gamma = 2 when
# (1 + a) / (c + v) >= (1 + a + a^2) / (2c + v), i.e. when c >= a^2 v / (1 + a - a^2).

# %%
a = 0.8
threshold = {v: a**2 * v / (1 + a - a**2) for v in (1, 1.5)}
for v, c_star in threshold.items():
    below, above = optimal_gamma(a, 0.9 * c_star, verify_cost=v), optimal_gamma(a, 1.1 * c_star, verify_cost=v)
    print(f"v = {v}: threshold c* = {c_star:.3f}; optimal gamma at 0.9 c*: {below}, at 1.1 c*: {above}")
print("E(1), E(2) at alpha 0.8:", expected_tokens_per_pass(a, 1), expected_tokens_per_pass(a, 2))

# %% [markdown]
# With alpha = 0.8 and v = 1 the threshold is c* = 0.64 / 1.16 = 0.55: a draft costing more than about
# half a target step should propose one token at a time. A dearer verification (v = 1.5) scales the
# threshold by 1.5 (0.83): when checking costs more, drafting more tokens per check pays for longer.

# %% [markdown]
# ## Exercise 3: tokens per pass from the acceptance per position, and the best gamma
# Draft i is examined only when drafts 1..i-1 were accepted, so it is accepted with probability
# a_1 a_2 ... a_i, and each accepted draft adds one token to the target's own: E(gamma) = 1 + a_1 +
# a_1 a_2 + ... + a_1 ... a_gamma. A pass costs gamma c + v(gamma) target steps; the speed-up is their ratio.

# %%
def tokens_per_pass(rates, gamma):
    total, kept = 1.0, 1.0
    for a in rates[:gamma]:
        kept *= a
        total += kept
    return total


def best_gamma(rates, c):
    speedups = {g: tokens_per_pass(rates, g) / (g * c + 1 + 0.1 * g) for g in range(1, len(rates) + 1)}
    return max(speedups, key=speedups.get), speedups


medusa_rates, eagle_rates = (0.6, 0.45, 0.35, 0.3), (0.75, 0.7, 0.7, 0.68, 0.65)
best = {"medusa": best_gamma(medusa_rates, 0.0), "eagle": best_gamma(eagle_rates, 0.1)}
for name, (g, speedups) in best.items():
    print(f"{name}: best gamma {g}; speed-up per gamma " + ", ".join(f"{k}: {v:.2f}" for k, v in speedups.items()))

# %% [markdown]
# Medusa's rates fall fast: its fourth draft is examined in only 0.6 * 0.45 * 0.35 = 9% of the passes,
# so it adds 0.03 tokens for a tenth of a step of verification; its best gamma is 2 (1.87 tokens per
# pass at a cost of 1.2: 1.56x). EAGLE's rates stay near 0.7, so it drafts further, gamma 3 (2.64 tokens
# per pass at a cost of 1.6: 1.65x), although each of its drafts costs c = 0.1; at c = 0 it would go
# deeper still. Acceptance that decays slowly is what lets a draft make long guesses.
