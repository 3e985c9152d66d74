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
# # 06 · Continuous batching: worked answers
#
# The exercises of `../06_continuous_batching.ipynb`, answered step by step. Try them first; each answer
# here is checked against an independent computation by `tests/library/test_notebook_exercises.py`.
# A small trace keeps this quick; the engine runs on the notebook's simulated clock (fixed step costs),
# so every number below is the same on every run.

# %%
import cs336_inference
import numpy as np

from cs336_inference.data import load_corpus
from cs336_inference.model import load_pretrained
from cs336_inference.serving import Engine, TraceConfig, make_trace

cs336_inference.apply_thread_policy()
model = load_pretrained("target").eval()


def step_seconds(batch) -> float:
    """The notebook's simulated clock: 10 ms per step plus 0.1 ms per token in it."""
    return 0.010 + 0.0001 * batch.num_tokens


config = TraceConfig(num_requests=6, rate=60.0, prompt_len=(16, 40), max_new_tokens=16, stop_tokens=(10,),
                     sampled_fraction=0.0, seed=0)   # no sampled requests (exercise 2)
requests = make_trace(load_corpus("val")[1000:], config)
runs = {(policy, seqs): Engine(model, scheduler=policy, max_num_seqs=seqs, step_time=step_seconds).run(requests)
        for policy in ("static", "continuous") for seqs in (1, 4)}

# %% [markdown]
# ## Exercise 1: the padding rows of static batching
# A row of a step is useful if it computes a token that is kept: each prefill row yields its first
# token, each decode row one more, except the rows of finished sequences a static batch still carries.

# %%
padding_rows, useful_rows = {}, {}
for policy in ("static", "continuous"):
    steps = runs[(policy, 4)].steps
    padding_rows[policy] = sum(s.num_padding for s in steps)
    useful_rows[policy] = sum(s.num_prefills + s.num_decodes - s.num_padding for s in steps)
generated = sum(o.num_generated for o in runs[("static", 4)].outputs)
print(f"padding rows {padding_rows}; useful rows {useful_rows}; tokens generated {generated}")

# %% [markdown]
# The useful rows add up to the tokens generated under both schedulers; only static batching carries
# padding (finished rows waiting for the batch's longest answer). Continuous batching has none: a
# finished sequence leaves at the next step.
#
# ## Exercise 2: one sequence at a time

# %%
steps_taken = {key: len(result.steps) for key, result in runs.items()}
print(steps_taken)

# %% [markdown]
# With `max_num_seqs=1` both schedulers run the requests one after the other, the same steps. With 4
# slots, continuous batching needs fewer steps: the whole difference comes from what shares a step.
#
# ## Exercise 3: p99 time to first token, by hand
# A request's TTFT is its first token's time minus its arrival time; `summary()` takes their 99th
# percentile (numpy's linear interpolation).

# %%
result = runs[("continuous", 4)]
ttft = [min(t[0] for t in o.token_times if t) - o.arrival_time for o in result.outputs]
ttft_p99 = float(np.percentile(ttft, 99))
print(f"by hand {ttft_p99:.4f} s, summary() {result.summary()['ttft_p99_s']:.4f} s")

# %% [markdown]
# With 6 requests the 99th percentile lies between the two largest values, 95% of the way: (6 - 1) x
# 0.99 = 4.95 positions into the sorted list. A p99 over a handful of requests is nearly the maximum;
# it needs many requests to mean "1 in 100".
