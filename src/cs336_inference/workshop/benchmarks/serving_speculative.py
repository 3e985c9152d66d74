"""`bench serving_speculative`: the serving engine with and without speculative decoding, by concurrency.

The lecture says the benefit of speculative decoding depends on the batch; this measures the curve.
For each workload and each concurrency c in (1, 4, 16, 64) (the engine's max_num_seqs, with
max(c, 4) requests arriving at once, so c sequences decode side by side), the same requests run on
the plain engine and on the engine with a proposer (`serving/speculative.py`), alternated, greedy:
tokens/s, p50/p99 inter-token latency, the median time per output token (TPOT), the share of drafts
accepted and the tokens each sequence gains per verify step: the median round (of at least three at
concurrency 1, where the goal is read). Every speculative run's outputs are checked equal to the plain
run's. Workloads: the shipped toy target on echo drills (each line repeats an earlier one:
input-grounded) with prompt lookup and with the shipped draft model, and SmolLM2-135M-Instruct (full
runs, where installed) asked to rewrite or summarise a held-out passage (`real_prompts`), with prompt
lookup and with the shipped Medusa heads and EAGLE draft (`serving/feature_proposers.py`; each at the
draft length `bench speculative_proposers` uses; both draft one sequence at a time, their draft forwards
not batched).

Tokens accepted in one step arrive together: a stream delivers them as one chunk, so the ITL between
them is 0 and the chunk's first token carries the wait (p50 ITL falls, p99 need not); TPOT counts
every token. Eager forwards (no compiled decode) and one CPU thread throughout; the engine's clock is
the process's CPU time (a busy shared machine inflates it far less than wall time).
"""

from __future__ import annotations

import statistics
import time

import matplotlib.pyplot as plt
from matplotlib.ticker import NullLocator

from ...data.corpus import corpus_documents
from ...generation.draft_heads import load_draft_heads
from ...model.checkpoints import load_pretrained
from ...model.real_models import real_model_missing
from ...model.tokenizer import load_tokenizer
from ...serving import Engine, SamplingParams
from ...serving.request import Request
from ...serving.speculative import PromptLookupProposer
from ...tables import print_table
from .base import Benchmark, alternate
from .speculative_heads import TASKS, chat_ids, held_out_paragraphs
from .speculative_proposers import GAMMAS

CONCURRENCIES = (1, 4, 16, 64)
NUM_SPECULATIVE_TOKENS = {"toy-echo": 4, "smollm2-grounded": 8}   # per workload: a verify of SmolLM2 on the
# CPU costs about the same for 5 to 9 positions (small-M matmuls are the dear ones), the toy's grows with them
PLAIN = "plain"
ROUNDS_AT_1 = 3   # concurrency 1 (the goal's point) is the cheapest and the noisiest: at least 3 alternated rounds
KEYS = ("throughput_tok_per_s", "itl_p50_s", "itl_p99_s", "tpot_p50_s")


def toy_workload(device, quick: bool) -> dict:
    target, draft = load_pretrained("target", device=device).eval(), load_pretrained("draft", device=device).eval()
    echoes = [list(d[:320].encode()) for d in corpus_documents("val") if d.startswith("Echo drill") and len(d) > 480]
    return {"name": "toy-echo", "model": target, "prompts": echoes, "max_tokens": 32 if quick else 96, "stop": (),
            "note": "shipped target, echo drills (320-byte prompts; each line repeats an earlier one)",
            "proposers": {"prompt lookup": lambda: dict(proposer=PromptLookupProposer()),
                          "draft model": lambda: dict(speculative="draft", draft_model=draft),
                          "prompt lookup, off above 4": lambda: dict(proposer=PromptLookupProposer(),
                                                                     speculative_disable_by_batch_size=4)}}


def real_prompts(tok) -> list[list[int]]:
    """Chat prompts: both tasks on each held-out help paragraph (no draft trained on these: `bench
    speculative_heads`), alternating, 2 x 15 distinct prompts. At concurrency 64 each runs two or three
    times; the prefix cache then shares its prompt blocks, with and without speculation."""
    held = held_out_paragraphs()
    n = len(held)
    return [chat_ids(tok, TASKS[(i % n + i // n) % 2] + held[i % n]) for i in range(2 * n)]


def real_workload(device) -> dict | None:
    name = "smollm2-135m"
    if missing := real_model_missing(name):
        print(f"({name} unavailable: {missing}; toy workload only)")
        return None
    target, tok = load_pretrained(name, device=device).eval().set_attention_kernel("sdpa"), load_tokenizer(name)
    prompts = real_prompts(tok)
    proposers = {"prompt lookup": lambda: dict(proposer=PromptLookupProposer())}
    for kind in ("medusa", "eagle"):   # the shipped heads, loaded once (not inside a timed run)
        try:
            heads = load_draft_heads(target, f"{kind}-smollm2")
        except ValueError as e:
            print(f"({kind} not measured: {e})")
            continue
        proposers[kind] = lambda kind=kind, heads=heads: dict(speculative=kind, draft_model=heads,
                                                              num_speculative_tokens=GAMMAS[kind])
    return {"name": "smollm2-grounded", "model": target, "prompts": prompts, "max_tokens": 64,
            "stop": tuple(tok.stop_ids), "note": "SmolLM2-135M-Instruct, chat: rewrite / summarise a given passage",
            "proposers": proposers}


def _requests(workload: dict, concurrency: int) -> list[Request]:
    prompts, n = workload["prompts"], max(concurrency, 4)
    params = SamplingParams(max_tokens=workload["max_tokens"], stop_token_ids=workload["stop"])
    return [Request(i, tuple(prompts[i % len(prompts)]), workload["max_tokens"], 0.0, params) for i in range(n)]


def _run(model, requests, concurrency: int, k: int, options: dict) -> dict:
    start = time.process_time()
    options = {"num_speculative_tokens": k} | options   # a proposer may bring its own draft length
    engine = Engine(model, max_num_seqs=concurrency, clock=lambda: time.process_time() - start, **options)
    result = engine.run(requests)
    s = result.summary()
    tpot = [(times[-1] - times[0]) / (len(times) - 1) for o in result.outputs for times in o.token_times
            if len(times) > 1]
    row = {key: s[key] for key in KEYS if key in s} | {
        "tpot_p50_s": statistics.median(tpot), "generated_tokens": s["generated_tokens"], "steps": s["steps"],
        "tokens": [o.tokens for o in result.outputs]}
    if engine.proposer is not None:
        sched = engine.scheduler
        row |= {"num_speculative_tokens": options["num_speculative_tokens"],
                "proposed": sched.num_proposed, "accepted": sched.num_accepted,
                "acceptance": sched.num_accepted / sched.num_proposed if sched.num_proposed else None,
                "tokens_per_verify": (sched.num_verified + sched.num_accepted) / sched.num_verified
                if sched.num_verified else None}
    return row


def measure_workload(workload: dict, concurrencies, repeats: int) -> dict:
    k = NUM_SPECULATIVE_TOKENS[workload["name"]]
    out = {"note": workload["note"], "max_tokens": workload["max_tokens"], "num_speculative_tokens": k,
           "concurrency": {}}
    model = workload["model"]
    for c in concurrencies:
        requests = _requests(workload, c)
        runs = alternate({PLAIN: lambda r=requests, c=c, k=k: _run(model, r, c, k, {}),
                          **{name: lambda make=make, r=requests, c=c, k=k: _run(model, r, c, k, make())
                             for name, make in workload["proposers"].items()}},
                         max(repeats, ROUNDS_AT_1) if c == 1 else repeats)
        point = {"requests": len(requests)}
        for name, rows in runs.items():
            assert all(r["tokens"] == runs[PLAIN][0]["tokens"] for r in rows), f"{name} changed a greedy output"
            median = sorted(rows, key=lambda r: r["throughput_tok_per_s"])[(len(rows) - 1) // 2]
            point[name] = {k: v for k, v in median.items() if k != "tokens"}
            if name != PLAIN:
                ratios = [r["throughput_tok_per_s"] / p["throughput_tok_per_s"] for r, p in zip(rows, runs[PLAIN])]
                point[name]["speedup"] = statistics.median(ratios)
                point[name]["speedup_range"] = [min(ratios), max(ratios)]
        out["concurrency"][str(c)] = point
        print(f"{workload['name']} c={c}: " + ", ".join(
            f"{name} {row['throughput_tok_per_s']:.1f} tok/s" + (
                f" ({row['speedup']:.2f}x, {row['acceptance'] or 0:.2f} accepted)" if name != PLAIN else "")
            for name, row in point.items() if name != "requests"))
    return out


def measure(run, concurrencies: tuple = CONCURRENCIES) -> dict:
    quick, device = run.quick, run.device
    concurrencies = (1, 4) if quick else tuple(concurrencies)
    workloads = [toy_workload(device, quick)] + ([] if quick else [w for w in [real_workload(device)] if w])
    results = {"device": str(device), "repeats": 1 if quick else 2, "workloads": {}}
    for w in workloads:
        repeats = results["repeats"] if w["name"] == "toy-echo" else 1
        results["workloads"][w["name"]] = measure_workload(w, concurrencies, repeats) | {"repeats": repeats}
    results["goals"], results["crossover"] = {}, {}
    for wname, w in results["workloads"].items():
        points = w["concurrency"]
        for proposer in next(iter(points.values())):
            if proposer in (PLAIN, "requests"):
                continue
            speedups = {int(c): p[proposer]["speedup"] for c, p in points.items()}
            results["goals"][f"{wname}, {proposer}: tokens/s at concurrency 1 >= 1.4x plain"] = speedups[1] >= 1.4
            losing = [c for c, s in sorted(speedups.items()) if s < 1]
            results["crossover"][f"{wname}, {proposer}"] = (
                f"a loss from concurrency {losing[0]}" if losing else "a gain at every concurrency measured")
    return results


def print_results(result: dict) -> None:
    for wname, w in result["workloads"].items():
        rows = []
        for c, point in sorted(w["concurrency"].items(), key=lambda item: int(item[0])):   # JSON sorts keys
            for name in [PLAIN] + sorted(n for n in point if n not in (PLAIN, "requests")):
                r = point[name]
                rows.append({"c": c, "engine": name, **r, "speedup": r.get("speedup", 1.0),
                             "num_speculative_tokens": r.get("num_speculative_tokens"),
                             "acceptance": r.get("acceptance"), "tokens_per_verify": r.get("tokens_per_verify")})
        print_table(rows, [("c", "concurrency", None), ("engine", "engine", None),
                           ("throughput_tok_per_s", "tok/s", "{:,.1f}"), ("speedup", "vs plain", "{:.2f}x"),
                           ("itl_p50_s", "ITL p50 (s)", "{:.4f}"), ("itl_p99_s", "ITL p99 (s)", "{:.4f}"),
                           ("tpot_p50_s", "TPOT p50 (s)", "{:.4f}"), ("num_speculative_tokens", "k", None),
                           ("acceptance", "drafts accepted", "{:.2f}"),
                           ("tokens_per_verify", "tokens / verify", "{:.2f}")],
                    title=f"\n{wname}: {w['note']}, {w['max_tokens']} new tokens, greedy, "
                          f"k drafts at most, median of {w['repeats']} alternated "
                          f"({max(w['repeats'], ROUNDS_AT_1)} at concurrency 1)")
    print("\n" + "\n".join(f"{k}: {v}" for k, v in result["crossover"].items()))
    print("goals: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in result["goals"].items()))


def plot_serving_speculative(result: dict):
    """Per workload: the tokens/s speed-up over the plain engine by concurrency, and p99 ITL / TPOT."""
    names = list(result["workloads"])
    fig, axes = plt.subplots(2, len(names), figsize=(6 * len(names), 8), squeeze=False)
    for col, wname in enumerate(names):
        w = result["workloads"][wname]
        cs = sorted(int(c) for c in w["concurrency"])   # the committed JSON sorts its keys as strings
        points = [w["concurrency"][str(c)] for c in cs]
        proposers = [n for n in points[0] if n not in (PLAIN, "requests")]
        ax = axes[0][col]
        for i, name in enumerate(proposers):
            k = points[0][name].get("num_speculative_tokens", w["num_speculative_tokens"])
            ax.plot(cs, [p[name]["speedup"] for p in points], "o-", color=f"C{i}", label=f"{name} (k = {k})")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(1.4, color="gray", lw=0.8, ls=":")
        ax.set(xscale="log", xticks=cs, xticklabels=[str(c) for c in cs], xlabel="concurrency (max_num_seqs)",
               ylabel="tokens/s vs the plain engine",
               title=f"{wname}: speed-up (k drafts at most)")
        ax.xaxis.set_minor_locator(NullLocator())
        ax.legend(fontsize=8)
        ax = axes[1][col]
        for i, name in enumerate([PLAIN] + proposers):
            color = "black" if name == PLAIN else f"C{i - 1}"
            ax.plot(cs, [1e3 * p[name]["itl_p99_s"] for p in points], "o-", color=color, label=f"{name}: ITL p99")
            ax.plot(cs, [1e3 * p[name]["tpot_p50_s"] for p in points], "s--", color=color, label=f"{name}: TPOT p50")
        ax.set(xscale="log", yscale="log", xticks=cs, xticklabels=[str(c) for c in cs],
               xlabel="concurrency (max_num_seqs)", ylabel="ms", title=f"{wname}: latency per token")
        ax.xaxis.set_minor_locator(NullLocator())
        ax.legend(fontsize=7)
    fig.suptitle("speculative decoding inside the engine: where it pays (greedy, one CPU thread)")
    fig.tight_layout()
    return fig


BENCHMARK = bench_serving_speculative = Benchmark("serving_speculative", measure, print_results,
                                                  plots={"{name}": plot_serving_speculative})

__all__ = ["bench_serving_speculative", "measure_workload", "print_results"]
