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
# # 06 · Continuous batching
#
# Live traffic is not a batch. Requests **arrive at different times**, **have different lengths**
# (prompts and answers), and often **share a prefix** (a system prompt, n samples of one prompt).
# Batching them like training data (wait, pad, run until the longest is done) leaves the hardware
# idle and users waiting. Orca (Yu et al., OSDI 2022) schedules at the level of *iterations*: before
# every decode step the engine admits waiting requests and retires finished ones, and it runs
# requests of different lengths together by batching everything except attention (*selective
# batching*).
#
# This notebook serves one request trace with the shipped target model through
# `cs336_inference.serving.Engine`, once with a static scheduler and once with a continuous one, and
# looks at who waited, who ran, and what came out.

# %%
import cs336_inference
import matplotlib.pyplot as plt

from cs336_inference import generate, get_device, seed_everything
from cs336_inference.data import load_corpus
from cs336_inference.figures import save_figure
from cs336_inference.model import ByteTokenizer, load_pretrained
from cs336_inference.serving import Engine, TraceConfig, make_trace
from cs336_inference.serving.plots import plot_batch_size, plot_timeline

device = get_device()
print("device:", device)
seed_everything(0)
print("CPU threads:", cs336_inference.apply_thread_policy())  # tiny model: one thread is fastest
model = load_pretrained("target", device=device).eval()
tokenizer = ByteTokenizer()

# %% [markdown]
# ## A trace
# 32 requests arrive as a Poisson process (60 per second on average: faster than the engine serves
# them, so a queue forms). Each prompt is a slice of the validation text; half of them start with the
# same 64-token "system prompt"; an answer ends with its line (stop token `\n`) or after 96 tokens;
# two in ten ask for 4 samples at temperature 0.8.

# %%
text = load_corpus("val")
system_prompt = text[:64].tolist()
config = TraceConfig(num_requests=32, rate=60.0, prompt_len=(32, 128), max_new_tokens=96, stop_tokens=(10,),
                     system_prompt_fraction=0.5, sampled_fraction=0.2, n_samples=4, seed=0)
requests = make_trace(text[1000:], config, system_prompt=system_prompt)
for r in requests[:6]:
    print(f"#{r.request_id:<2} arrives {r.arrival_time:5.2f} s  prompt {len(r.prompt):3} tokens  n={r.sampling.n}  "
          f"...{tokenizer.decode(list(r.prompt[-30:]))!r}")

# %% [markdown]
# ## Static vs continuous batching
# Same engine, same KV memory, same limit of 12 sequences per step; only the scheduler differs.
# * static: a batch is what has arrived when the previous batch finished; it runs until its longest
#   answer is done (finished rows stay in the batch as padding, as in `generate` on a batch);
# * continuous: every step admits arrived requests while memory and the batch limit allow.
#
# The engine runs on a simulated clock, as in the lecture: `Engine(..., step_time=step_seconds)` advances
# time by a fixed cost per step (10 ms, plus 0.1 ms per token it computes: a memory-bound step, as on a
# GPU, costs about the same for 1 or 12 sequences). So every number below is the same on every run;
# drop `step_time=` to time this CPU instead.

# %%
def step_seconds(batch) -> float:
    return 0.010 + 0.0001 * batch.num_tokens


runs = {policy: Engine(model, scheduler=policy, max_num_seqs=12, step_time=step_seconds).run(requests)
        for policy in ("static", "continuous")}
for policy, result in runs.items():
    s = result.summary()
    print(f"{policy:>10}: {s['throughput_tok_per_s']:6.0f} tok/s | TTFT p50 {s['ttft_p50_s'] * 1e3:5.0f} ms, "
          f"p99 {s['ttft_p99_s'] * 1e3:5.0f} ms | ITL p50 {s['itl_p50_s'] * 1e3:4.1f} ms, p99 "
          f"{s['itl_p99_s'] * 1e3:5.1f} ms | mean queueing {s['queueing_mean_s'] * 1e3:5.0f} ms | {s['steps']} steps")
static, continuous = runs["static"].summary(), runs["continuous"].summary()
print(f"continuous batching took {static['steps'] / continuous['steps']:.2f}x fewer steps and served "
      f"{continuous['throughput_tok_per_s'] / static['throughput_tok_per_s']:.2f}x the tokens/s of static batching")

fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
for ax, (policy, result) in zip(axes, runs.items()):
    plot_timeline(ax, result, f"{policy}: grey = waiting, colour = running")
    plot_batch_size(axes[2], result, policy)
axes[2].set_title("sequences producing a token per step")
axes[2].legend()
fig.tight_layout()
save_figure(fig, "06_continuous_batching_timeline")
plt.show()

# %% [markdown]
# Under static batching late arrivals wait for the whole batch (the grey bars), and a batch drains:
# fewer and fewer rows produce a token while the longest answer finishes. Continuous batching refills
# a slot at the very next step, so more tokens come out per step and nobody waits for a stranger's
# long answer. On the simulated clock, as on a GPU, a step costs about the same for 1 or 12 sequences, so
# every idle row is lost throughput; timed on this CPU (no `step_time`), a row costs a little, so the gap
# is smaller (the lecture shows the committed wall-clock run on SmolLM2).
#
# ## Selective batching: one forward, ragged sequences
# Each step concatenates the new tokens of every scheduled sequence into one row, `[sum of T_b, D]`:
# a prefill brings its whole (uncached) prompt, a decode one token. Projections and the MLP run on the
# concatenated tokens; attention runs per sequence through its block table.

# %%
steps = runs["continuous"].steps
mixed = [r for r in steps if r.num_prefills and r.num_decodes][:5]
for r in mixed:
    print(f"t={r.start:5.3f} s: {r.num_prefills} prefill(s) + {r.num_decodes} decode(s): one forward over "
          f"[{' + '.join(map(str, r.tokens_per_sequence))}, D] = [{r.num_tokens}, {model.config.d_model}]")

# %% [markdown]
# ## Same tokens as `generate`
# Scheduling changes *when* a token is computed, never *which*: every greedy request's answer equals
# what `generate` gives for that prompt alone, under both schedulers.

# %%
greedy = [i for i, r in enumerate(requests) if r.sampling.temperature == 0]
for i in greedy:
    r = requests[i]
    alone = generate(model, [list(r.prompt)], r.max_new_tokens, stop_tokens=list(r.sampling.stop_token_ids)).tokens[0]
    assert runs["static"].outputs[i].tokens == runs["continuous"].outputs[i].tokens == [alone]
print(f"{len(greedy)} greedy requests: identical to generate(), token for token")
r, out = requests[greedy[0]], runs["continuous"].outputs[greedy[0]]
print(repr(tokenizer.decode(list(r.prompt[-40:]))), "->", repr(tokenizer.decode(out.tokens[0])))

# %% [markdown]
# ## When memory runs out: preemption by recompute
# With a KV pool far too small for 12 sequences, the continuous scheduler admits what fits; when a
# running sequence needs a new block and none is free, the youngest sequence is preempted: its blocks
# are freed and it re-enters the queue, to be re-prefilled later (prompt + what it had generated).
# Outputs do not change, only the time they take.

# %%
small = Engine(model, scheduler="continuous", max_num_seqs=12, block_size=16, num_blocks=40,
               watermark_blocks=0, step_time=step_seconds).run(requests)
s = small.summary()
print(f"{small.num_blocks} blocks of 16 tokens: {s['preemptions']} preemptions, at most {s['max_running']} running, "
      f"{s['throughput_tok_per_s']:.0f} tok/s")
assert all(small.outputs[i].tokens == runs["continuous"].outputs[i].tokens for i in greedy)
print("greedy outputs unchanged")

# %% [markdown]
# ## Summary
# - Live traffic arrives at different times, with different lengths and shared prefixes; a static batch
#   makes late arrivals wait and keeps finished rows as padding until its longest answer is done.
# - Continuous (iteration-level) batching decides who runs before every step: finished sequences leave,
#   waiting ones join, so more useful tokens come out per step, with the same outputs.
# - Selective batching runs a step's ragged sequences as one [sum of T_b, D] batch for everything but
#   attention, which runs per sequence over its own cache.
# - When KV memory runs out, preemption (free the blocks, recompute later) keeps the engine going.
#
# ## Exercises
# 1. From `runs["static"].steps`, count the padding rows (`num_padding`) and check that the useful rows
#    (`num_prefills + num_decodes - num_padding`) add up to the tokens generated (`num_generated` of the
#    outputs); how many padding rows does continuous batching have?
# 2. Serve a trace without sampled requests (`sampled_fraction=0.0`) with `Engine(..., max_num_seqs=1)`:
#    both schedulers then take the same number of steps. Batching is where the difference comes from.
# 3. Recompute `summary()["ttft_p99_s"]` from the outputs yourself: each request's first token time
#    (`token_times`) minus its `arrival_time`, then `numpy.percentile`.
#
# Worked answers: `answers/06_continuous_batching.ipynb` (checked by `tests/library/test_notebook_exercises.py`).
