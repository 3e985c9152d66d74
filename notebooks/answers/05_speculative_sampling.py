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
