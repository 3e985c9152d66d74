"""`bench speculative`'s proposer comparison on SmolLM2: Medusa heads (as a chain, and verified as a tree
of their top guesses), the EAGLE draft (as a chain, and growing EAGLE-2's tree: `eagle_tree`), prompt
lookup, prompt lookup with the EAGLE draft where it finds no match (`lookup_eagle`), the EAGLE tree with
prompt lookup's copy as one more branch (`lookup_eagle_tree`), and the small draft `bench speculative_draft`
pruned and distilled (`distilled_draft`, where that bench has left it in the cache folder), on the same held-out
prompts, in one run.

The target is the CLI's default fast path (`fast_path.load_for_inference`: the published int4 blocks on
our kernels, fused attention, the CPU tuning). Greedy decoding, batch 1. Per proposer: tokens per
target pass, alpha and P(accept draft i | 1..i-1 accepted), and the decode speed-up over plain
greedy decoding of the same model (prefill excluded; eager, and the fast path's compiled decode step
where it compiles), each prompt decoded plainly and speculatively back to back, on the wall clock
and on this process's CPU clock. One thread for everything, as `bench speculative`'s sweep: on a
shared 2-core machine a second OpenMP thread waits at every parallel region for a core another
process holds, and the eager draft steps have no thread switch of their own; with one thread the
CPU clock is the time the work ran, however busy the machine.
The prompts are the ones `speculative_heads` held out of the heads' training.

Beside them, what checking costs here (`verify_cost`): a compiled pass of T tokens against the compiled
decode step, alternated on one cache. A pass that costs c(T) decode steps pays only where it emits more
than c(T) tokens on average; on a GPU c stays near 1 for small T (decode is memory-bound), on a CPU's
int4 kernel each row adds its own arithmetic.
"""

from __future__ import annotations

import statistics
from functools import partial
from pathlib import Path

import torch

from ...generation.draft_heads import SHIPPED, load_drafter
from ...generation.eagle import EagleDrafter
from ...generation.eagle_tree import eagle_tree_generate
from ...generation.lookup_then_draft import LookupThenDraft
from ...generation.medusa_tree import medusa_tree_generate
from ...generation.prompt_lookup import PromptLookupDrafter
from ...generation.speculative import SpeculativeResult, speculative_generate
from ...generation.speculative_costs import timed
from ...model import checkpoints
from ...model.disk_cache import cache_dir
from ...model.real_models import real_model_missing
from ...model.transformer import TransformerLM
from ...device import load_avg
from .base import Benchmark
from .speculative_heads import HELD_OUT_SUBJECT, MODEL, TASKS, chat_ids, held_out_paragraphs

GAMMAS = {"medusa": 4, "medusa_tree": 4, "eagle": 5, "prompt_lookup": 4, "prompt_lookup_fast": 3, "lookup_eagle": 5,
          "eagle_tree": 6, "lookup_eagle_tree": 6, "distilled_draft": 4}
EAGLE_TREE = dict(depth=6, top_k=8, budget=32)   # EAGLE-2 runs 8B targets 6 deep, 10 wide, 60 nodes; a CPU pays per row
LOOKUP_TOKENS = 20                              # lookup_eagle_tree's copied branch: at most this many tokens
# medusa_tree, eagle_tree, lookup_eagle_tree: the tree's depth (the copied branch may reach deeper:
# P(accept i) is counted for the first 6). prompt_lookup_fast: prompt lookup after a match of at least 2 tokens on the
# fast path's compiled steps: the passes with drafts through `compile_verify`, those without through the
# compiled decode step, as plain decoding runs; 3 drafts, as a pass's cost grows with every row (`verify_cost`).
# lookup_eagle: prompt lookup's copy where the last 2-4 tokens occur earlier, the EAGLE draft's guesses otherwise


def held_out_prompts(tok, quick: bool) -> list[tuple[str, list[int]]]:
    """(kind, chat prompt ids): rewrite / summarise held-out paragraphs (i % 5 == 1), and a story."""
    n = 1 if quick else 4
    grounded = [("grounded", chat_ids(tok, TASKS[i % 2] + par)) for i, par in enumerate(held_out_paragraphs()[:n])]
    return grounded + [("free", chat_ids(tok, f"Write a short story about {HELD_OUT_SUBJECT}."))]


def _plain_compiled(model, prompt: list[int], new: int, step, stop: set[int]) -> list[int]:
    """Greedy decoding with a compiled decode step (`step(token_ids (1,), cache) -> logits (1, V)`)."""
    with torch.inference_mode():   # the cache too, as the speculative loop's: both then run one compiled graph
        cache = model.new_cache(1, len(prompt) + new)
        token = model(torch.tensor([prompt], device=model.device), cache=cache, last_only=True)[0, -1].argmax()
        out = [int(token)]
        while len(out) < new and out[-1] not in stop:
            token = step(token.reshape(1), cache)[0].argmax()
            out.append(int(token))
    return out


def compare_proposers(run, repeats: int = 1) -> dict | None:
    """The comparison (None where SmolLM2 is not installed)."""
    if missing := real_model_missing(MODEL):
        print(f"(proposer comparison skipped: {missing})")
        return None
    from ..fast_path import load_for_inference

    quick = run.quick
    target, tok, banner = load_for_inference(MODEL)
    torch.set_num_threads(1)   # batch-1 decoding is latency work: one thread, as the sweep (see the docstring)
    banner += "; run here on 1 thread"
    print(banner, flush=True)
    stop, new = tok.stop_ids, 32 if quick else 128
    proposers, notes = _proposers(target)
    compiled = _compiled_steps(target, tok, stop, notes)
    prompts = held_out_prompts(tok, quick)
    costs = _verify_cost(target, *compiled, prompts[0][1]) if compiled else None
    rows, per_prompt = {}, []
    for _ in range(repeats):
        for kind, prompt in prompts:
            entry = _measure_prompt(target, proposers, compiled, kind, prompt, new, stop, rows)
            per_prompt.append(entry)
            print(f"  {kind} prompt ({len(prompt)} tokens): plain {entry['plain_eager'][0]:.1f} tok/s; "
                  + ", ".join(f"{n} {entry[n][0] / entry['plain_eager'][0]:.2f}x" for n in proposers), flush=True)
    out = [_summary_row(name, results, per_prompt) for name, results in rows.items()]
    return dict(model=MODEL, device=str(run.device), threads=torch.get_num_threads(), load_avg_end=load_avg(),
                banner=banner, new_tokens=new, repeats=repeats, prompts=[k for k, _ in prompts],
                assets=list(SHIPPED), notes=notes, per_prompt=per_prompt, rows=out, verify_cost=costs)


def _proposers(target) -> tuple[dict, dict]:
    """(name -> drafter, name -> why it is missing): the shipped heads, and prompt lookup."""
    proposers, notes = {}, {}
    for name in ("medusa", "eagle"):
        try:
            proposers[name] = load_drafter(target, f"{name}-smollm2")
        except ValueError as err:
            notes[name] = str(err)
    if "medusa" in proposers:   # the same heads, verified as Medusa's tree of top guesses (greedy rule: exact)
        proposers["medusa_tree"] = proposers["medusa"].heads
    proposers["prompt_lookup"] = "prompt_lookup"
    proposers["prompt_lookup_fast"] = PromptLookupDrafter(max_ngram=4, min_ngram=2)
    if "eagle" in proposers:   # its own EagleDrafter (its own cache) on the same shipped draft
        proposers["lookup_eagle"] = LookupThenDraft(EagleDrafter(target, proposers["eagle"].draft), 4, 2)
        proposers["eagle_tree"] = proposers["lookup_eagle_tree"] = proposers["eagle"].draft   # greedy rule: exact
    draft, why_not = distilled_draft(target)
    if draft is not None:
        proposers["distilled_draft"] = draft
    else:
        notes["distilled_draft"] = why_not
    return proposers, notes


def distilled_draft_path() -> Path:
    """Where `bench speculative_draft` leaves the SmolLM2 draft it pruned and distilled: the package's cache
    folder, as the draft (about 100 MB in bf16) is too large to ship."""
    return cache_dir() / "drafts" / f"{MODEL}-pruned-distilled.pt"


def distilled_draft(target: TransformerLM) -> tuple[TransformerLM | None, str | None]:
    """(the distilled draft on the target's device, None), or (None, why it is not compared)."""
    path = distilled_draft_path()
    if not path.is_file():
        return None, (f"no distilled SmolLM2 draft in {path} (`bench speculative_draft` prunes and distils one, "
                      "in about half an hour, and leaves it there); not compared")
    draft = checkpoints.load(path, device=target.device)
    if draft.config.vocab_size != target.config.vocab_size:
        return None, (f"{path} is not a draft for {MODEL}: its vocabulary has {draft.config.vocab_size} ids, "
                      f"the target's {target.config.vocab_size}; not compared")
    return draft.eval(), None


def _compiled_steps(target, tok, stop, notes: dict):
    """(the compiled decode step, the compiled verify pass), compiled now; None (and a note) where the
    compiler is missing or fails."""
    from ..fast_path import compile_fast, compile_fast_verify

    try:
        compiled, verify = compile_fast(target), compile_fast_verify(target)
        warm = held_out_prompts(tok, True)[0][1]
        _plain_compiled(target, warm, 4, compiled, set(stop))
        # and on a speculative loop's cache (it keeps room to roll back): any recompiling happens now
        speculative_generate(target, PromptLookupDrafter(), warm, 2, max_new_tokens=8, decode_step=compiled,
                             verify_step=verify)
        with torch.inference_mode():   # a pass of 2 or more tokens (the one graph for every such T)
            cache = target.new_cache(1, len(warm) + 4)
            target(torch.tensor([warm], device=target.device), cache=cache, last_only=True)
            verify(torch.tensor([warm[-3:]], device=target.device), cache)
        return compiled, verify
    except Exception as err:   # a compiler missing or failing here: compare with eager decoding only
        notes["compiled"] = f"compiled decode step unavailable: {type(err).__name__}: {err}"[:300]
        return None


def _verify_cost(target, step, verify, prompt: list[int], sizes=(*range(1, 10), 17, 33),
                 rounds: int = 7) -> list[dict]:
    """A compiled pass of T tokens (each of `sizes`; 33: the EAGLE tree's root and 32 nodes) after `prompt`, in
    CPU ms (median of `rounds`, the T's alternated in each round) and in compiled decode steps (T = 1 is
    the decode step itself)."""
    max_tokens = max(sizes)
    ids = torch.tensor([prompt[-max_tokens:]], device=target.device)
    times = {T: [] for T in sizes}
    with torch.inference_mode():
        cache = target.new_cache(1, len(prompt) + max_tokens)
        target(torch.tensor([prompt], device=target.device), cache=cache, last_only=True)
        start = cache.length
        for _ in range(rounds):
            for T, taken in times.items():
                run = partial(step, ids[0, :1], cache) if T == 1 else partial(verify, ids[:, :T], cache)
                taken.append(timed(run, target.device)[2])   # this process's CPU time: one thread, however busy
                cache.truncate(start)
    step_ms = statistics.median(times[1]) * 1e3
    return [dict(tokens=T, ms=statistics.median(t) * 1e3, decode_steps=statistics.median(t) * 1e3 / step_ms)
            for T, t in times.items()]


def _rate(tokens: int, times: tuple, prefill: tuple) -> tuple[float, float]:
    """Decode tokens/s on both clocks, the prefill and first token taken out."""
    return tuple((tokens - 1) / max(t - p, 1e-9) for t, p in zip(times, prefill))


def _measure_prompt(target, proposers: dict, compiled, kind: str, prompt: list[int], new: int, stop,
                    rows: dict) -> dict:
    """One prompt: plain eager (and compiled) decoding, then each proposer; its results are added to `rows`."""
    runs = [timed(lambda: _plain_compiled(target, prompt, 1, None, set()), target.device)[1:] for _ in range(3)]
    prefill = tuple(statistics.median(r[i] for r in runs) for i in (0, 1))   # plain prefill + first token
    ref, *plain = timed(partial(_plain_eager, target, prompt, new, set(stop)), target.device)
    entry = dict(kind=kind, prompt_tokens=len(prompt), tokens=len(ref), plain_eager=_rate(len(ref), plain, prefill))
    step, verify = compiled or (None, None)
    if compiled is not None:
        got, *t = timed(partial(_plain_compiled, target, prompt, new, step, set(stop)), target.device)
        entry["plain_compiled"] = _rate(len(got), t, prefill)
        entry["compiled_matches_eager"] = got == ref
    for name, drafter in proposers.items():
        if name == "medusa_tree":
            decode = partial(medusa_tree_generate, target, drafter, prompt, new, stop_tokens=stop)
        elif name in ("eagle_tree", "lookup_eagle_tree"):
            decode = partial(eagle_tree_generate, target, drafter, prompt, new, stop_tokens=stop, **EAGLE_TREE,
                             lookup_tokens=LOOKUP_TOKENS if name == "lookup_eagle_tree" else 0)
        else:
            fast = name == "prompt_lookup_fast"
            decode = partial(speculative_generate, target, drafter, prompt, GAMMAS[name], max_new_tokens=new,
                             stop_tokens=stop, decode_step=step if fast else None, verify_step=verify if fast else None)
        res, *t = timed(decode, target.device)
        entry[name] = _rate(res.num_generated, t, prefill)
        entry[f"{name}_matches_plain"] = res.tokens == ref
        if isinstance(drafter, LookupThenDraft):   # which source proposed in how many passes
            entry[f"{name}_passes_by_source"] = dict(lookup=drafter.lookup_passes, draft=drafter.draft_passes)
        rows.setdefault(name, []).append(res)
    return entry


def _summary_row(name: str, results: list, per_prompt: list[dict]) -> dict:
    """One proposer over every prompt: tokens per pass (all, grounded, free), acceptance, speed-ups."""
    gamma = GAMMAS[name]
    pooled = SpeculativeResult([], 0, gamma, proposed=[g for r in results for g in r.proposed],
                               accepted=[k for r in results for k in r.accepted])
    row = dict(proposer=name, gamma=gamma, tokens_per_pass=pooled.mean_tokens_per_pass, alpha=pooled.alpha,
               acceptance_by_position=pooled.acceptance_by_position,
               greedy_matches_plain=all(e[f"{name}_matches_plain"] for e in per_prompt))
    if all(f"{name}_passes_by_source" in e for e in per_prompt):
        for source in ("lookup", "draft"):
            row[f"{source}_passes"] = sum(e[f"{name}_passes_by_source"][source] for e in per_prompt)
    for kind in ("grounded", "free"):
        passes = [k for r, e in zip(results, per_prompt) if e["kind"] == kind for k in r.accepted]
        if passes:
            row[f"tokens_per_pass_{kind}"] = sum(k + 1 for k in passes) / len(passes)
    return row | _speedups(name, per_prompt)


def _speedups(name: str, per_prompt: list[dict]) -> dict:
    """speedup_over_{plain_eager, plain_compiled}_{wall, cpu}: the proposer's decode rate over the baseline's,
    summed over the prompts (where every prompt has that baseline)."""
    return {f"speedup_over_{base}_{clock}": sum(e[name][i] for e in per_prompt) / sum(e[base][i] for e in per_prompt)
            for base in ("plain_eager", "plain_compiled") if all(base in e for e in per_prompt)
            for i, clock in enumerate(("wall", "cpu"))}


def _plain_eager(model, prompt: list[int], new: int, stop: set[int]) -> list[int]:
    """Greedy decoding one eager forward per token (what `generate` runs, without its batching)."""
    return _plain_compiled(model, prompt, new, lambda token, cache: model(token[:, None], cache=cache)[:, -1], stop)


def print_proposers(r: dict) -> None:
    from ...tables import print_table

    print(r["banner"])
    rows = [dict(row, **{f"a{i + 1}": a for i, a in enumerate(row["acceptance_by_position"])}) for row in r["rows"]]
    f2 = "{:.2f}"
    cols = [("proposer", "proposer", None), ("gamma", "gamma", None), ("tokens_per_pass", "tok/pass", f2),
            ("tokens_per_pass_grounded", "grounded", f2), ("tokens_per_pass_free", "free", f2), ("alpha", "alpha", f2)]
    cols += [(f"a{i + 1}", f"P(acc {i + 1})", f2) for i in range(max(x["gamma"] for x in r["rows"]))]
    cols += [(f"speedup_over_{b}_{c}", f"x {b.removeprefix('plain_')} ({c})", f2)
             for b in ("plain_eager", "plain_compiled") for c in ("wall", "cpu") if f"speedup_over_{b}_{c}" in rows[0]]
    cols += [(f"{source}_passes", f"{source} passes", None) for source in ("lookup", "draft")
             if any(f"{source}_passes" in row for row in rows)]
    cols += [("greedy_matches_plain", "= plain", None)]
    print_table(rows, cols)
    if r.get("verify_cost"):
        print("a compiled pass of T tokens, in compiled decode steps: "
              + ", ".join(f"T={c['tokens']} {c['decode_steps']:.2f}" for c in r["verify_cost"])
              + f" (one step {r['verify_cost'][0]['ms']:.1f} ms)")
    for k, v in r["notes"].items():
        print(f"note ({k}): {v}")


def plot_proposers(r: dict):
    import matplotlib.pyplot as plt

    costs = r.get("verify_cost")
    fig, (left, right, *cost) = plt.subplots(1, 3 if costs else 2, figsize=(16 if costs else 11, 3.8))
    colors = {"medusa": "tab:red", "medusa_tree": "tab:orange", "eagle": "tab:purple", "prompt_lookup": "tab:green",
              "prompt_lookup_fast": "tab:olive", "lookup_eagle": "tab:brown", "distilled_draft": "tab:blue",
              "eagle_tree": "tab:pink", "lookup_eagle_tree": "tab:gray"}
    for row in r["rows"]:
        rates = [x if x is not None else float("nan") for x in row["acceptance_by_position"]]
        left.plot(range(1, len(rates) + 1), rates, marker="o", color=colors.get(row["proposer"]),
                  label=f"{row['proposer']} ({row['tokens_per_pass']:.2f} tok/pass)")
    left.set(ylim=(0, 1.45), xlabel="draft position i (a tree: depth i)", ylabel="P(accept i | 1..i-1 accepted)",
             title=f"{r['model']}, greedy, held-out prompts")
    left.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])   # the room above 1 holds the legend
    left.legend(fontsize=7, ncol=2, loc="upper center")
    bases = [b for b in ("plain_eager", "plain_compiled") if f"speedup_over_{b}_wall" in r["rows"][0]]
    width = 0.8 / max(1, len(bases))
    for j, base in enumerate(bases):
        xs = [i + j * width for i in range(len(r["rows"]))]
        right.bar(xs, [row[f"speedup_over_{base}_wall"] for row in r["rows"]], width,
                  label=f"over plain ({base.removeprefix('plain_')} step)", alpha=0.8)
    right.set_xticks([i + width * (len(bases) - 1) / 2 for i in range(len(r["rows"]))],
                     [row["proposer"] for row in r["rows"]], rotation=25, ha="right")
    right.axhline(1.0, color="gray", lw=0.8)
    right.set(ylabel="decode speed-up (wall clock)", title="batch 1, the fast path's model")
    right.legend(fontsize=8)
    if costs:
        T = [c["tokens"] for c in costs]
        cost[0].plot(T, [c["decode_steps"] for c in costs], marker="o", label="cost of a pass (decode steps)")
        cost[0].plot(T, T, ls="--", color="gray", label="tokens it can emit (all drafts accepted)")
        cost[0].axhline(1.0, color="gray", lw=0.8)
        cost[0].set(xlabel="tokens in the pass (1 + drafts)", ylabel="compiled decode steps",
                    title="what checking costs here")
        cost[0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def _plot_or_none(r: dict):
    return plot_proposers(r) if r.get("rows") else None


# `bench speculative` (and `--model smollm2-135m` alone) writes the comparison under this name
BENCHMARK = proposers_report = Benchmark("speculative_proposers", compare_proposers, print_proposers,
                             plots={"speculative_proposers": _plot_or_none})
