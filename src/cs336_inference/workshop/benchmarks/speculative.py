"""`bench speculative`: plain vs speculative decoding, measured and predicted; `bench speculative_draft`.

For each workload (a target, its drafters, prompts), temperature and gamma: decode tokens/s of plain
`generate` and of `speculative_generate`, alternated, so the speed-up is a ratio measured side by
side (prefill subtracted; with one CPU thread on the process's CPU clock, which a busy shared machine
does not inflate). Beside it, the speed-up the theory predicts from the measured alpha and costs
(`generation.speculative_costs`; `paper` is Leviathan et al.'s formula, which assumes v = 1).
Workloads: the shipped toy pair on stories and on echo drills (where prompt lookup shines), and
SmolLM2-135M-Instruct with prompt lookup on chat tasks that copy a passage, and on free writing;
then Medusa, EAGLE and prompt lookup side by side on SmolLM2, written as its own result
(`speculative_proposers`; alone with `--model smollm2-135m` or `bench speculative_proposers`).
`bench speculative_draft` prunes and distils a SmolLM2 draft (Minitron-style) on a CPU time budget.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from functools import partial

import matplotlib.pyplot as plt
import torch
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

from ...compression import distill, importance_scores, prune_model
from ...data.corpus import corpus_documents
from ...data.real_text import prose_paragraphs
from ...data.training import TrainConfig
from ...generation.generate import generate
from ...generation.speculative import SpeculativeResult, speculative_generate
from ...generation.speculative_costs import CLOCKS, measure_costs, predicted_speedup, timed
from ...generation.speculative_theory import expected_speedup, optimal_gamma
from ...model import checkpoints
from ...model.checkpoints import load_pretrained
from ...model.real_models import real_model_missing
from ...model.tokenizer import load_tokenizer
from ...tables import print_table
from ...device import describe_machine, load_avg
from .base import Benchmark, Run
from .speculative_heads import HELD_OUT_SUBJECT, TASKS, chat_ids, held_out_paragraphs
from .speculative_proposers import compare_proposers, distilled_draft_path, proposers_report

TEMPERATURES = (0.0, 1.0)


@dataclass
class Workload:
    name: str
    target: torch.nn.Module
    drafters: dict            # name -> TransformerLM or "prompt_lookup"
    prompts: list[list[int]]
    max_new_tokens: int
    note: str = ""
    stop_tokens: list[int] | None = None
    gammas: tuple[int, ...] | None = None  # None: the benchmark's sweep
    extra: dict = field(default_factory=dict)


def toy_workloads(device, quick: bool) -> list[Workload]:
    target = load_pretrained("target", device=device)
    draft, scratch = load_pretrained("draft", device=device), load_pretrained("draft-scratch", device=device)
    n_prompts, new = (1, 32) if quick else (2, 96)
    docs = corpus_documents("val")
    stories = [list(d[:64].encode()) for d in docs if d.startswith("Once upon a time")][:n_prompts]
    echoes = [list(d[:320].encode()) for d in docs if d.startswith("Echo drill") and len(d) > 480][:n_prompts]
    return [Workload("toy-story", target, {"draft": draft, "draft-scratch": scratch, "prompt_lookup": "prompt_lookup"},
                     stories, new, "free continuation of a story opening (64 bytes)"),
            Workload("toy-echo", target, {"draft": draft, "prompt_lookup": "prompt_lookup"}, echoes, new,
                     "echo drills: each line repeats an earlier one (320-byte prompt), an input-grounded task")]


def real_workloads(device, quick: bool) -> list[Workload]:
    """SmolLM2-135M-Instruct (when its package is installed) with prompt lookup: chat tasks whose
    answer copies a given passage (edit, summarise), and free writing where nothing can be copied."""
    name = "smollm2-135m"
    if missing := real_model_missing(name):
        print(f"(real model unavailable: {missing}; toy workloads only)")
        return []
    target, tok = load_pretrained(name, device=device), load_tokenizer(name)

    n_prompts, new = (1, 24) if quick else (2, 128)
    grounded = [chat_ids(tok, TASKS[i % 2] + par) for i, par in enumerate(held_out_paragraphs()[:n_prompts])]
    free = [chat_ids(tok, f"Write a short story about {HELD_OUT_SUBJECT}.")]  # contrast
    lookup, extra = {"prompt_lookup": "prompt_lookup"}, dict(model=name, parameters=target.num_parameters(),
                                                             dtype=str(target.dtype))
    return [Workload("smollm2-grounded", target, lookup, grounded, new, "SmolLM2-135M-Instruct, chat: rewrite / "
                     "summarise a given passage (the answer copies the input)", tok.stop_ids, extra=extra),
            Workload("smollm2-free", target, lookup, free, new // 2, "SmolLM2-135M-Instruct, chat: write a story "
                     "(nothing to copy from the prompt)", tok.stop_ids, gammas=(1, 2, 4, 8), extra=extra)]


def pooled(results: list[SpeculativeResult], gamma: int) -> SpeculativeResult:
    """Many runs' passes as one result: its `alpha` and `acceptance_by_position` pool every pass."""
    return SpeculativeResult([], 0, gamma, proposed=[g for r in results for g in r.proposed],
                             accepted=[k for r in results for k in r.accepted])


@torch.inference_mode()
def measure_prefills(workload: Workload, repeats: int = 5) -> dict:
    """Seconds of each prompt's prefill + first token, plain and with each drafter: what decode time excludes."""
    def median_cost(fn):
        fn()   # warm-up
        times = [timed(fn, workload.target.device)[1:] for _ in range(repeats)]
        return {k: statistics.median(t[i] for t in times) for i, k in enumerate(CLOCKS)}

    out, target = {}, workload.target
    for i, prompt in enumerate(workload.prompts):
        out[("plain", i)] = median_cost(partial(generate, target, [prompt], 1))
        for name, draft in workload.drafters.items():
            out[(name, i)] = median_cost(partial(speculative_generate, target, draft, prompt, 1, max_new_tokens=1))
    return out


def _generation(workload: Workload, draft, i: int, gamma: int, temperature: float, seed: int) -> tuple:
    """Prompt i decoded plainly (draft None) or speculatively: (i, tokens after the first, wall s, CPU s,
    the SpeculativeResult or None)."""
    target, prompt = workload.target, workload.prompts[i]
    kw = dict(temperature=temperature, stop_tokens=workload.stop_tokens,
              generator=torch.Generator(device=target.device).manual_seed(seed))
    if draft is None:
        out, wall, cpu = timed(lambda: generate(target, [prompt], workload.max_new_tokens, **kw), target.device)
        return i, len(out.tokens[0]) - 1, wall, cpu, None
    out, wall, cpu = timed(lambda: speculative_generate(target, draft, prompt, gamma,
                                                        max_new_tokens=workload.max_new_tokens, **kw), target.device)
    return i, out.num_generated - 1, wall, cpu, out


def _decode_rate(runs: list[tuple], prefill: dict, who: str, clock: str) -> float:
    """Tokens after the first / (run time - its prefill) over a set of runs."""
    k = 2 + CLOCKS.index(clock)
    return sum(r[1] for r in runs) / sum(r[k] - prefill[(who, r[0])][clock] for r in runs)


def run_workload(workload: Workload, gammas, repeats: int, clock: str, temperatures=TEMPERATURES):
    """Every (temperature, drafter, gamma): pooled acceptance, measured speed-up per repeat (decode
    tokens/s, prefill subtracted, on `clock` and on the wall), the prediction; plus the measured costs."""
    prefill, prompts, target = measure_prefills(workload), range(len(workload.prompts)), workload.target
    prompt = workload.prompts[0]   # costs at a typical context: the prompt + half its greedy answer
    context = prompt + generate(target, [prompt], workload.max_new_tokens // 2,
                                stop_tokens=workload.stop_tokens).tokens[0]
    costs, rows = {}, []
    for temperature in temperatures:
        costs[f"T={temperature:g}"] = cost = measure_costs(target, workload.drafters, context, gammas, temperature)
        plain, spec = [], {}   # per repeat: plain runs (each prompt, before each drafter's sweep); speculative
        for rep in range(repeats):
            plain.append([])
            for drafter, draft in workload.drafters.items():
                plain[-1] += [_generation(workload, None, i, 0, temperature, rep) for i in prompts]
                for gamma in gammas:
                    spec.setdefault((drafter, gamma), []).append(
                        [_generation(workload, draft, i, gamma, temperature, rep) for i in prompts])
        plain_rate = {c: [_decode_rate(runs, prefill, "plain", c) for runs in plain] for c in CLOCKS}
        for (drafter, gamma), reps in spec.items():
            results = [run[4] for runs in reps for run in runs]
            passes = pooled(results, gamma)
            speedups = {c: [_decode_rate(runs, prefill, drafter, c) / base for runs, base in zip(reps, plain_rate[c])]
                        for c in CLOCKS}
            main = speedups[clock]
            row = dict(workload=workload.name, drafter=drafter, temperature=temperature, gamma=gamma,
                       alpha=passes.alpha or 0.0, acceptance_by_position=passes.acceptance_by_position,
                       tokens_per_pass=sum(r.num_generated - 1 for r in results) / len(passes.accepted),
                       measured_speedup=statistics.median(main), measured_speedup_min=min(main),
                       measured_speedup_max=max(main), measured_speedup_wall=statistics.median(speedups["wall"]),
                       plain_tok_per_s=statistics.median(plain_rate[clock]))
            row["spec_tok_per_s"] = row["plain_tok_per_s"] * row["measured_speedup"]
            row |= predicted_speedup(cost, drafter, row["alpha"], gamma, passes.proposed, clock)
            row["measured_over_predicted"] = row["measured_speedup"] / row["predicted_speedup"]
            rows.append(row)
    costs["prefill"] = {f"{name} prompt {i}": v for (name, i), v in prefill.items()}
    return rows, costs


def measure(run, workloads=None, model: str | None = None) -> dict:
    """Every workload (default: the toy pair's, and SmolLM2's where installed). Batch-1 decoding is
    latency work: one thread (CS336_NUM_THREADS overrides), timed on the CPU clock; with more, the wall.
    Then the proposers on SmolLM2 (`speculative_proposers`: Medusa, EAGLE, prompt lookup); with
    --model smollm2-135m only those, written as figures/speculative_proposers.json."""
    if model is not None:
        if model != "smollm2-135m":
            raise ValueError(f"bench speculative --model takes smollm2-135m (the proposer comparison alone), "
                             f"got {model!r}")
        run.name, run.report = "speculative_proposers", proposers_report   # figures/speculative_proposers.json
        return compare_proposers(run)
    if workloads is None:   # the proposer comparison first, as its own result (figures/speculative_proposers.json)
        proposers = compare_proposers(run)
        if proposers is not None:   # with where it ran, as the scaffold records it for a result it writes
            proposers["machine"] = describe_machine(run.device) | dict(load_avg_end=load_avg())
            proposers_report.write(Run("speculative_proposers", run.device, run.quick, run.committed), proposers)
    device, quick = run.device, run.quick
    clock = "cpu" if device.type == "cpu" and torch.get_num_threads() == 1 else "wall"
    gammas, repeats, t0 = ((1, 4) if quick else tuple(range(1, 9))), 1 if quick else 3, time.perf_counter()
    workloads = workloads if workloads is not None else toy_workloads(device, quick) + real_workloads(device, quick)
    rows, costs, notes = [], {}, {}
    for w in workloads:
        w_gammas = gammas if w.gammas is None or quick else w.gammas
        print(f"{w.name}: {len(w.prompts)} prompt(s), {w.max_new_tokens} new tokens, gamma {list(w_gammas)}, "
              f"drafters {list(w.drafters)}", flush=True)
        w_rows, costs[w.name] = run_workload(w, w_gammas, repeats, clock)
        rows += w_rows
        notes[w.name] = dict(note=w.note, prompts=len(w.prompts), max_new_tokens=w.max_new_tokens,
                             prompt_tokens=[len(p) for p in w.prompts], **w.extra)
    return dict(device=str(device), threads=torch.get_num_threads(), clock=clock, gammas=list(gammas),
                repeats=repeats, seconds=time.perf_counter() - t0, workloads=notes, costs=costs, rows=rows)


def print_speculative(result: dict) -> None:
    f2 = "{:.2f}"
    print_table(result["rows"], [
        ("workload", "workload", None), ("drafter", "drafter", None), ("temperature", "T", "{:g}"),
        ("gamma", "gamma", None), ("alpha", "alpha", f2), ("tokens_per_pass", "tok/pass", f2),
        ("cost_ratio", "c", "{:.3f}"), ("verify_cost", "v", f2), ("paper_speedup", "paper (v=1)", f2),
        ("predicted_speedup", "predicted", f2), ("measured_speedup", f"measured ({result['clock']})", f2),
        ("measured_speedup_min", "min", f2), ("measured_speedup_max", "max", f2),
        ("measured_speedup_wall", "wall", f2), ("measured_over_predicted", "meas/pred", f2)])


# The figures: one panel per workload (two columns), so each reads at lecture size; a drafter is a
# colour; greedy (T=0) is measured (solid, min..max bars) next to the prediction from the measured
# alpha and costs (dashed); sampling (T=1) is the measured line alone (dotted, hollow markers).
COLORS = {"draft": "tab:blue", "draft-scratch": "tab:orange", "prompt_lookup": "tab:green"}
STYLES = [Line2D([], [], color="gray", marker="o", label="T=0 measured"),
          Line2D([], [], color="gray", ls="--", label="T=0 predicted"),
          Line2D([], [], color="gray", ls=":", marker="o", mfc="none", label="T=1 measured")]


def _panels(workloads: list[str], height: float = 3.6):
    cols = min(2, len(workloads))
    fig, axes = plt.subplots(math.ceil(len(workloads) / cols), cols, figsize=(6.2 * cols, height * math.ceil(
        len(workloads) / cols)), squeeze=False)
    for ax in axes.flat[len(workloads):]:
        ax.set_visible(False)
    return fig, axes.flat


def plot_speculative(result: dict):
    rows = result["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = _panels(workloads)
    for ax, workload in zip(axes, workloads):
        mine = [r for r in rows if r["workload"] == workload]
        drafters = list(dict.fromkeys(r["drafter"] for r in mine))
        for drafter in drafters:
            color = COLORS.get(drafter)
            for temperature in sorted({r["temperature"] for r in mine}):
                rs = sorted((r for r in mine if r["drafter"] == drafter and r["temperature"] == temperature),
                            key=lambda r: r["gamma"])
                g, measured = [r["gamma"] for r in rs], [r["measured_speedup"] for r in rs]
                if temperature == 0:
                    err = [[r["measured_speedup"] - r["measured_speedup_min"] for r in rs],
                           [r["measured_speedup_max"] - r["measured_speedup"] for r in rs]]
                    ax.errorbar(g, measured, yerr=err, marker="o", ms=4, capsize=2, color=color)
                    ax.plot(g, [r["predicted_speedup"] for r in rs], "--", color=color)
                else:
                    ax.plot(g, measured, ":", marker="o", ms=4, mfc="none", color=color)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(title=workload, xlabel="gamma (draft tokens per pass)", ylabel="speed-up over the target alone")
        _drafter_legend(ax, drafters)
    fig.legend(handles=STYLES, loc="upper center", ncol=3, fontsize=9, bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def _drafter_legend(ax, drafters, **where) -> None:
    ax.legend(handles=[Line2D([], [], color=COLORS.get(d), lw=3, label=d) for d in drafters], fontsize=8,
              title="drafter", title_fontsize=8, **where)


def plot_acceptance(result: dict):
    """P(accept draft i | drafts 1..i-1 accepted) at each workload's largest gamma (solid T=0, dotted T=1)."""
    rows = result["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = _panels(workloads, height=3.2)
    for ax, workload in zip(axes, workloads):
        mine = [r for r in rows if r["workload"] == workload]
        gamma = max(r["gamma"] for r in mine)
        for r in (r for r in mine if r["gamma"] == gamma):
            rates = [x if x is not None else float("nan") for x in r["acceptance_by_position"]]
            ax.plot(range(1, len(rates) + 1), rates, marker="o", ms=4, color=COLORS.get(r["drafter"]),
                    **({"ls": "-"} if r["temperature"] == 0 else {"ls": ":", "mfc": "none"}))
        ax.set(ylim=(0, 1.3), yticks=[0, 0.2, 0.4, 0.6, 0.8, 1.0], xlim=(0.5, gamma + 0.5),
               title=f"{workload} (gamma = {gamma})", xlabel="draft position i", ylabel="P(accept i | 1..i-1 accepted)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        drafters = list(dict.fromkeys(r["drafter"] for r in mine))
        _drafter_legend(ax, drafters, loc="upper center", ncol=len(drafters))   # above the probabilities
    fig.legend(handles=[STYLES[0], STYLES[2]], labels=["T=0", "T=1"], loc="upper center", ncol=2, fontsize=9,
               bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


BENCHMARK = bench_speculative = Benchmark(
    "speculative", measure, print_speculative,
    plots={"speculative": plot_speculative, "speculative_acceptance": plot_acceptance})


# --- bench speculative_draft -----------------------------------------------------------------------

DRAFT_SHAPE = dict(num_layers=8, d_ff=1024)  # of 30 layers and d_ff 1536; d_model and heads kept
DRAFT_GAMMA = 4


def draft_training_text(tok) -> torch.Tensor:
    """One token stream: every help-page paragraph as plain text, and each prose paragraph as a chat
    task answered by copying it (what the target does). Every held-out paragraph stays out, not only
    the two `bench speculative` decodes: `bench speculative_proposers` decodes four of them with the draft."""
    from pydoc_data.topics import topics

    held_out = set(held_out_paragraphs())

    pieces = [tok.encode(par) + tok.stop_ids[-1:] for name in sorted(topics) for par in topics[name].split("\n\n")
              if par.strip() and " ".join(par.split()) not in held_out]
    for i, par in enumerate(prose_paragraphs()):
        if par not in held_out:
            chat = tok.apply_chat_template([{"role": "user", "content": TASKS[i % 2] + par}])
            pieces.append(tok.encode(chat + par) + tok.stop_ids[:1])
    return torch.tensor([t for p in pieces for t in p])


@torch.inference_mode()
def _acceptance(target, draft, prompts, stop, new: int = 64):
    """Pooled acceptance over `prompts` (greedy, gamma DRAFT_GAMMA)."""
    return pooled([speculative_generate(target, draft, p, DRAFT_GAMMA, max_new_tokens=new, stop_tokens=stop)
                   for p in prompts], DRAFT_GAMMA)


def measure_draft(run, minutes: float = 30.0) -> dict | None:
    """Prune SmolLM2 to DRAFT_SHAPE (`compression.prune_model`), distil it for `minutes` of CPU training
    on offline text (CPython's help pages, plain and as the chat tasks above); alpha on the grounded
    prompts before and after, the measured cost ratio c and the predicted speed-up."""
    device, quick = run.device, run.quick
    workloads = [w for w in real_workloads(device, quick) if w.name == "smollm2-grounded"]
    if not workloads:
        print("bench speculative_draft needs the real model (SmolLM2-135M); nothing to do")
        return None
    w, tok = workloads[0], load_tokenizer("smollm2-135m")
    target, prompts, minutes = w.target, w.prompts, 1.0 if quick else minutes
    stream = draft_training_text(tok)
    split = int(0.95 * len(stream))
    train, val = stream[:split], stream[split:]
    calibration = train[: 8 * 257].view(8, 257)
    scores = importance_scores(target, calibration)
    draft = prune_model(target, calibration, scores=scores, **DRAFT_SHAPE)
    alpha_pruned = _acceptance(target, draft, prompts, w.stop_tokens).alpha
    print(f"pruned to {DRAFT_SHAPE} ({draft.num_parameters():,} parameters): alpha {alpha_pruned:.2f} before "
          "distillation", flush=True)
    cfg = TrainConfig(steps=2, batch_size=2, seq_len=256, lr=5e-4, warmup_steps=1, eval_every=2, eval_batches=1,
                      progress=False, device=str(device))
    t0 = time.perf_counter()   # two steps on a throwaway copy: how many fit in the budget
    distill(prune_model(target, calibration, scores=scores, **DRAFT_SHAPE), target, cfg, train_data=train,
            val_data=val)
    step_s = (time.perf_counter() - t0) / 2
    steps = max(2, int(minutes * 60 / step_s))
    print(f"distillation: {step_s:.1f} s per step -> {steps} steps in {minutes:g} minutes", flush=True)
    t0 = time.perf_counter()
    _, history = distill(draft, target, cfg.replace(steps=steps, warmup_steps=min(20, steps // 10 + 1),
                                                    eval_every=max(1, steps // 4), eval_batches=2),
                         train_data=train, val_data=val)
    train_minutes = (time.perf_counter() - t0) / 60
    passes = _acceptance(target, draft.eval(), prompts, w.stop_tokens)
    alpha = passes.alpha
    c = measure_costs(target, {"draft": draft}, prompts[0], (DRAFT_GAMMA,), repeats=10)["draft"][DRAFT_GAMMA]
    c = c["draft"]["wall"]   # draft cost per token / target's, on the wall clock
    best = optimal_gamma(alpha, c, max_gamma=16)
    saved = None
    if not quick:   # for `bench speculative_proposers`, which compares it with the heads on its own prompts
        saved = distilled_draft_path()
        saved.parent.mkdir(parents=True, exist_ok=True)
        checkpoints.save(saved, draft, dict(target="smollm2-135m", steps=steps, alpha=alpha), dtype=torch.bfloat16)
        print(f"saved the draft to {saved}", flush=True)
    return dict(saved_to=None if saved is None else str(saved), device=str(device), threads=torch.get_num_threads(),
                draft_shape=DRAFT_SHAPE,
                draft_parameters=draft.num_parameters(), target_parameters=target.num_parameters(),
                train_tokens=len(train), steps=steps, step_seconds=step_s, train_minutes=train_minutes,
                history={k: v for k, v in history.items() if isinstance(v, list)},
                alpha_pruned=alpha_pruned, alpha_distilled=alpha, acceptance_by_position=passes.acceptance_by_position,
                cost_ratio=c, best_gamma=best, predicted_speedup=expected_speedup(alpha, best, c),
                used_in_bench_speculative=alpha >= 0.5)


def print_draft(r: dict) -> None:
    print(f"alpha: pruned {r['alpha_pruned']:.2f} -> distilled {r['alpha_distilled']:.2f} after {r['steps']} steps "
          f"({r['train_minutes']:.0f} min); c = {r['cost_ratio']:.2f}; best gamma {r['best_gamma']}: predicted "
          f"speed-up {r['predicted_speedup']:.2f}x")


bench_speculative_draft = Benchmark("speculative_draft", measure_draft, print_draft, parallel=True)
