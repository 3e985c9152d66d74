"""`bench speculative`: plain target decoding vs speculative decoding, measured and predicted.

For each workload (a target, its drafters, prompts), temperature (0 and 1) and gamma (1..8):
decode tokens/s of plain `generate(target)` and of `speculative_generate`, run alternately in one
process (plain before each drafter's sweep, in every repeat), so the speed-up is a ratio measured
side by side. Decode time = the run's time minus its prefill (timed alone). With one CPU thread the
primary clock is the process's CPU time, which a busy shared machine does not inflate; wall-clock
is reported beside it.

Next to it, the speed-up the theory predicts from the *measured* acceptance rate alpha and the
*measured* costs, in units of one plain decode step of the target (forward + sampling), each part
timed alone in the same run (`measure_costs`):
  c  one draft token (draft forward + sampling), or one prompt lookup (per pass),
  v  the target's verification pass over g + 1 tokens, accept rule included.
predicted = mean_j E[tokens | alpha, g_j] / mean_j (g_j c + v(g_j)), with g_j the drafts proposed in
pass j (always gamma for a model draft, except near the end); `paper` is Leviathan et al.'s
E[tokens | alpha, gamma] / (gamma c + 1), which assumes a memory-bound target (v = 1).

Workloads: the shipped toy pair on two kinds of text, stories (free generation) and echo drills
(lines that repeat earlier lines: input-grounded, where prompt lookup shines).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from ..data.corpus import VAL_EVERY, build_corpus
from ..device import get_device, seed_everything
from ..figures import save_json
from ..generation.generate import generate
from ..generation.prompt_lookup import prompt_lookup_propose
from ..generation.drafters import SamplingParams
from ..generation.sampling import sample_next_token
from ..generation.speculative import speculative_generate
from ..generation.speculative_rule import greedy_accept, speculative_accept
from ..generation.speculative_theory import expected_speedup, expected_tokens_per_pass
from ..model.checkpoints import load_pretrained
from ..model.tokenizer import ENDOFTEXT
from ..timing import sync_device
from .roofline import threads_for_timing

TEMPERATURES = (0.0, 1.0)


@dataclass
class Workload:
    name: str
    target: torch.nn.Module
    drafters: dict            # name -> TransformerLM or "prompt_lookup"
    prompts: list[list[int]]
    max_new_tokens: int
    note: str = ""
    extra: dict = field(default_factory=dict)


def _val_documents(prefix: str) -> list[str]:
    docs = build_corpus(0).decode("utf-8").split(ENDOFTEXT)
    return [d for i, d in enumerate(docs) if i % VAL_EVERY == VAL_EVERY - 1 and d.startswith(prefix)]


def toy_workloads(device, quick: bool) -> list[Workload]:
    target = load_pretrained("target", device=device)
    draft, scratch = load_pretrained("draft", device=device), load_pretrained("draft-scratch", device=device)
    n_prompts, new = (1, 32) if quick else (2, 96)
    stories = [list(d[:64].encode()) for d in _val_documents("Once upon a time")[:n_prompts]]
    echoes = [list(d[:320].encode()) for d in _val_documents("Echo drill") if len(d) > 480][:n_prompts]
    return [
        Workload("toy-story", target, {"draft": draft, "draft-scratch": scratch, "prompt_lookup": "prompt_lookup"},
                 stories, new, "free continuation of a story opening (64 bytes)"),
        Workload("toy-echo", target, {"draft": draft, "prompt_lookup": "prompt_lookup"}, echoes, new,
                 "echo drills: each line repeats an earlier one (320-byte prompt), an input-grounded task"),
    ]


def _timed(fn, device):
    """(fn(), wall seconds, CPU seconds of this process), device-synchronised."""
    sync_device(device)
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    sync_device(device)
    return out, time.perf_counter() - wall, time.process_time() - cpu


def _median_cost(fn, device, repeats: int) -> dict:
    fn()  # warm-up
    times = [_timed(fn, device)[1:] for _ in range(repeats)]
    return {"wall": statistics.median(t[0] for t in times), "cpu": statistics.median(t[1] for t in times)}


@torch.inference_mode()
def measure_costs(workload: Workload, gammas, temperature: float, repeats: int = 30) -> dict:
    """Seconds (wall and CPU), each timed alone at the workload's typical context (prompt + half the
    output), of what the loops do per token or per pass, sampling included:
      token      one plain decode step of the target: forward + sample (the unit of cost);
      DRAFTER    one draft token: draft forward + sample (model), or one search (prompt lookup, per pass);
      verify[g]  the target's pass over g + 1 tokens + the accept rule."""
    target, device = workload.target, workload.target.device
    sampling = SamplingParams(temperature)
    gen = torch.Generator(device=device).manual_seed(0)
    context = len(workload.prompts[0]) + workload.max_new_tokens // 2
    ids = torch.tensor([(workload.prompts[0] * 8)[:context]], device=device)
    V = target.config.vocab_size

    def at_context(model, num_tokens: int, then) -> dict:
        cache = model.new_cache(1, context + num_tokens)
        model(ids, cache=cache, start_pos=0)
        new = torch.randint(0, V, (1, num_tokens), device=device, generator=gen)

        def run():
            then(model(new, cache=cache, start_pos=context)[0])   # (num_tokens, V)
            cache.truncate(context)
        return _median_cost(run, device, repeats)

    def sample(logits):  # what `generate` and the model drafter do with each token's logits
        return sample_next_token(logits[-1], temperature, generator=gen).tolist()

    def accept(g):
        drafts = torch.randint(0, V, (g,), device=device, generator=gen)
        p = torch.softmax(torch.randn(g, V, device=device, generator=gen), -1)

        def rule(logits):
            if sampling.greedy:
                return greedy_accept(drafts.tolist(), logits.argmax(-1).tolist())
            return speculative_accept(p, sampling.probs(logits), drafts, gen)
        return rule

    costs = {"token": at_context(target, 1, sample),
             "verify": {g: at_context(target, g + 1, accept(g)) for g in range(max(gammas) + 1)}}
    for name, draft in workload.drafters.items():
        if draft == "prompt_lookup":
            seq = ids[0].tolist()
            costs[name] = {g: _median_cost(lambda: prompt_lookup_propose(seq, g), device, repeats) for g in gammas}
        else:
            costs[name] = at_context(draft, 1, sample)
    return costs


@torch.inference_mode()
def measure_prefills(workload: Workload) -> dict:
    """Seconds of each prompt's prefill + first token, plain and with each drafter: what decode time excludes."""
    out, target, device = {}, workload.target, workload.target.device
    for i, prompt in enumerate(workload.prompts):
        out[("plain", i)] = _median_cost(lambda: generate(target, [prompt], 1), device, 5)
        for name, draft in workload.drafters.items():
            out[(name, i)] = _median_cost(lambda: speculative_generate(target, draft, prompt, 1, max_new_tokens=1),
                                          device, 5)
    return out


def _predict(costs: dict, clock: str, drafter: str, is_lookup: bool, proposed: list[int], alpha: float,
             gamma: int) -> dict:
    """The theory's speed-up from measured alpha and measured costs (see the module docstring)."""
    token = costs["token"][clock]
    verify = {g: costs["verify"][g][clock] / token for g in costs["verify"]}
    tokens = statistics.fmean(expected_tokens_per_pass(alpha, g) for g in proposed)
    if is_lookup:
        lookup = costs[drafter][gamma][clock] / token  # one search per pass
        cost = statistics.fmean(lookup + verify[g] for g in proposed)
        c = lookup / gamma                             # per drafted token, for the paper formula
    else:
        c = costs[drafter][clock] / token
        cost = statistics.fmean(g * c + verify[g] for g in proposed)
    return dict(predicted_speedup=tokens / cost, paper_speedup=expected_speedup(alpha, gamma, c),
                cost_ratio=c, verify_cost=verify[gamma], predicted_tokens_per_pass=tokens)


def _plain(workload: Workload, prompt, temperature: float, seed: int):
    g = torch.Generator(device=workload.target.device).manual_seed(seed)
    return _timed(lambda: generate(workload.target, [prompt], workload.max_new_tokens, temperature=temperature,
                                   generator=g), workload.target.device)


def _speculative(workload: Workload, draft, prompt, gamma: int, temperature: float, seed: int):
    g = torch.Generator(device=workload.target.device).manual_seed(seed)
    return _timed(lambda: speculative_generate(workload.target, draft, prompt, gamma, temperature,
                                               max_new_tokens=workload.max_new_tokens, generator=g),
                  workload.target.device)


def _acceptance(results, gamma: int) -> tuple[float, list]:
    """Pooled alpha (accepted / examined) and acceptance by draft position over many runs."""
    passes = [(g, k) for r in results for g, k in zip(r.proposed, r.accepted)]
    examined = sum(k + (k < g) for g, k in passes)
    alpha = sum(k for _, k in passes) / examined if examined else 0.0
    by_position = []
    for i in range(gamma):
        tried = sum(1 for g, k in passes if g > i and k >= i)
        by_position.append(sum(1 for _, k in passes if k > i) / tried if tried else None)
    return alpha, by_position


def run_workload(workload: Workload, gammas, repeats: int, clock: str, temperatures=TEMPERATURES):
    """Every (temperature, drafter, gamma): pooled acceptance, measured speed-up per repeat (decode
    time, prefill subtracted, on `clock` and on the wall), the prediction; plus the measured costs."""
    prefill = measure_prefills(workload)
    costs = {}
    rows = []
    for temperature in temperatures:
        costs[temperature] = measure_costs(workload, gammas, temperature)
        plain = {c: [] for c in ("wall", "cpu")}  # per repeat: decode seconds of all plain runs
        spec = {}                                 # (drafter, gamma) -> per repeat: [(result, wall, cpu)]
        for rep in range(repeats):
            runs = []
            for drafter, draft in workload.drafters.items():  # plain runs before each drafter's sweep
                runs += [_plain(workload, p, temperature, rep)[1:] + (i,) for i, p in enumerate(workload.prompts)]
                for gamma in gammas:
                    spec.setdefault((drafter, gamma), []).append(
                        [_speculative(workload, draft, p, gamma, temperature, rep) + (i,)
                         for i, p in enumerate(workload.prompts)])
            for k, c in enumerate(("wall", "cpu")):
                plain[c].append(sum(t[k] - prefill[("plain", t[2])][c] for t in runs) / len(workload.drafters))
        for (drafter, gamma), reps in spec.items():
            results = [r for rep in reps for r, *_ in rep]
            alpha, by_position = _acceptance(results, gamma)
            speedups = {}
            for k, c in enumerate(("wall", "cpu"), start=1):
                decode = [sum(t[k] - prefill[(drafter, t[3])][c] for t in rep) for rep in reps]
                speedups[c] = [p / s for p, s in zip(plain[c], decode)]
            main = speedups[clock]
            passes = sum(r.target_forwards for r in results)
            row = dict(workload=workload.name, drafter=drafter, temperature=temperature, gamma=gamma,
                       alpha=alpha, acceptance_by_position=by_position,
                       tokens_per_pass=sum(r.num_generated - 1 for r in results) / passes,
                       measured_speedup=statistics.median(main), measured_speedup_min=min(main),
                       measured_speedup_max=max(main), measured_speedup_wall=statistics.median(speedups["wall"]),
                       plain_tok_per_s=len(workload.prompts) * (workload.max_new_tokens - 1)
                       / statistics.median(plain[clock]))
            row["spec_tok_per_s"] = row["plain_tok_per_s"] * row["measured_speedup"]
            row.update(_predict(costs[temperature], clock, drafter, workload.drafters[drafter] == "prompt_lookup",
                                [g for r in results for g in r.proposed], alpha, gamma))
            row["measured_over_predicted"] = row["measured_speedup"] / row["predicted_speedup"]
            rows.append(row)
    costs = {f"T={t:g}": c for t, c in costs.items()}  # JSON keys
    costs["prefill"] = {f"{name} prompt {i}": v for (name, i), v in prefill.items()}
    return rows, costs


def _print_table(rows: list[dict], clock: str) -> None:
    print(f"\n{'workload':<10} {'drafter':<14} {'T':>2} {'g':>2} {'alpha':>5} {'tok/pass':>8} {'c':>6} {'v':>5} "
          f"{'paper':>6} {'pred':>6} {'measured (' + clock + ') [min, max]':>27} {'wall':>5} {'meas/pred':>9}")
    for r in rows:
        print(f"{r['workload']:<10} {r['drafter']:<14} {r['temperature']:>2.0f} {r['gamma']:>2} {r['alpha']:>5.2f} "
              f"{r['tokens_per_pass']:>8.2f} {r['cost_ratio']:>6.3f} {r['verify_cost']:>5.2f} "
              f"{r['paper_speedup']:>6.2f} {r['predicted_speedup']:>6.2f} {r['measured_speedup']:>12.2f} "
              f"[{r['measured_speedup_min']:.2f}, {r['measured_speedup_max']:.2f}] "
              f"{r['measured_speedup_wall']:>5.2f} {r['measured_over_predicted']:>9.2f}")


def bench_speculative(quick: bool = False, device: str | None = None, workloads=None) -> dict:
    """Run every workload; print the table; write figures/speculative(.json, .png) (or *_quick)."""
    device = get_device(device)
    seed_everything(0)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads_for_timing(device))
    # One CPU thread: the process's CPU time is the run's time on an idle core, however busy the
    # shared machine is (wall-clock is reported beside it). Otherwise wall-clock is the measure.
    clock = "cpu" if device.type == "cpu" and torch.get_num_threads() == 1 else "wall"
    try:
        gammas = (1, 4) if quick else tuple(range(1, 9))
        repeats = 1 if quick else 3
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        workloads = workloads if workloads is not None else toy_workloads(device, quick)
        rows, costs, notes = [], {}, {}
        for w in workloads:
            w_rows, costs[w.name] = run_workload(w, gammas, repeats, clock)
            rows += w_rows
            notes[w.name] = dict(note=w.note, prompts=len(w.prompts), max_new_tokens=w.max_new_tokens,
                                 prompt_tokens=[len(p) for p in w.prompts], **w.extra)
        result = dict(device=str(device), threads=torch.get_num_threads(), clock=clock, gammas=list(gammas),
                      repeats=repeats, load_average_before=load_before, load_average_after=os.getloadavg()[0],
                      seconds=time.perf_counter() - t0, workloads=notes, costs=costs, rows=rows)
    finally:
        torch.set_num_threads(threads_before)
    _print_table(rows, clock)
    print(f"\nload average {result['load_average_before']:.1f} -> {result['load_average_after']:.1f} on "
          f"{os.cpu_count()} cores, {result['threads']} thread(s), {result['seconds']:.0f} s")
    name = "speculative_quick" if quick else "speculative"
    save_json(result, name)
    from .speculative_plot import plot_speculative
    plot_speculative(result, name)
    return result
