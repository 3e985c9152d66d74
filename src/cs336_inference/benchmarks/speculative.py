"""`bench speculative`: plain target decoding vs speculative decoding, measured and predicted.

For each workload (a target, its drafters, prompts), temperature (0 and 1) and gamma (1..8): decode
tokens/s of plain `generate` and of `speculative_generate`, run alternately (plain before each
drafter's sweep, every repeat), so the speed-up is a ratio measured side by side; decode time is a
run's time minus its prefill (timed alone). With one CPU thread the clock is the process's CPU time,
which a busy shared machine does not inflate (wall-clock beside it).

Next to it, the speed-up the theory predicts from the *measured* alpha and *measured* costs, in units
of one plain decode step of the target (forward + sampling), timed in the same run (`measure_costs`):
  c  one draft token (draft forward + sampling; drafter and verifier take turns, as in the loop, since
     on a CPU they evict each other's weights), or one prompt lookup per pass;
  v  the target's verification pass over g + 1 tokens, accept rule included.
predicted = mean_j E[tokens | alpha, g_j] / mean_j (g_j c + v(g_j)) over the passes j (g_j drafts
proposed); `paper` is Leviathan et al.'s E[tokens | alpha, gamma] / (gamma c + 1), which assumes a
memory-bound target (v = 1). Workloads: `speculative_workloads`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from functools import partial

import torch

from ..generation.generate import generate
from ..generation.prompt_lookup import prompt_lookup_propose
from ..generation.drafters import SamplingParams
from ..generation.sampling import sample_next_token
from ..generation.speculative import speculative_generate
from ..generation.speculative_rule import accept_unchecked, greedy_accept
from ..generation.speculative_theory import expected_speedup, expected_tokens_per_pass
from ..tables import print_table
from ..timing import sync_device
from .base import Benchmark
from .speculative_plot import plot_acceptance, plot_speculative
from .speculative_workloads import Workload, real_workloads, toy_workloads

TEMPERATURES = (0.0, 1.0)


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


class _StepTimer:
    """A model with its cache prefilled to `context` tokens: `step(T, then)` times one forward over T
    new tokens followed by `then(logits (T, V))`, and rolls the cache back, so every call sees the
    same context."""

    def __init__(self, model, ids: torch.Tensor, gen: torch.Generator):
        self.model, self.context = model, ids.shape[1]
        self.cache = model.new_cache(1, self.context + 16)  # room for the largest pass (gamma + 1 <= 16)
        model(ids, cache=self.cache)
        self.gen = gen

    def step(self, num_tokens: int, then) -> tuple[float, float]:
        model, device = self.model, self.model.device
        new = torch.randint(0, model.config.vocab_size, (1, num_tokens), device=device, generator=self.gen)

        def run():
            then(model(new, cache=self.cache)[0])  # (num_tokens, V)
            self.cache.truncate(self.context)
        return _timed(run, device)[1:]


def _median_ratios(cycles: list[dict], unit: str = "token") -> dict:
    """{name: {clock: median over cycles of (name's seconds / the unit's seconds in the same cycle)}}:
    ratios taken within one cycle (a few ms) are robust to the load drifting on a shared machine."""
    return {name: {k: statistics.median(c[name][i] / c[unit][i] for c in cycles) for i, k in enumerate(("wall", "cpu"))}
            for name in cycles[0] if name != unit}


@torch.inference_mode()
def measure_costs(workload: Workload, gammas, temperature: float, repeats: int = 30) -> dict:
    """Costs in units of one plain decode step of the target (forward + sample), at the workload's
    typical context (prompt + half its greedy output), sampling and the accept rule included. Each
    cost is timed in cycles that also time one plain step, as a median of per-cycle ratios:
      verify[g]       the target's pass over g + 1 tokens + the accept rule;
      DRAFTER[gamma]  a model drafter in the loop's rhythm (gamma draft tokens, then the verification):
                      'draft' per draft token (forward + sample), 'verify' per pass. Two models taking
                      turns evict each other's weights from the CPU's private caches, so both cost
                      more than timed alone;
      prompt_lookup[gamma]  one search, per pass.
    `token` is the plain step itself, in seconds."""
    target, device = workload.target, workload.target.device
    sampling = SamplingParams(temperature)
    gen = torch.Generator(device=device).manual_seed(0)
    prompt = workload.prompts[0]
    half = generate(target, [prompt], workload.max_new_tokens // 2, stop_tokens=workload.stop_tokens).tokens[0]
    ids = torch.tensor([prompt + half], device=device)
    V = target.config.vocab_size

    def sample(logits):  # what `generate` and the model drafter do with each token's logits
        return sample_next_token(logits[-1], temperature, generator=gen).tolist()

    def accept(g):
        drafts = torch.randint(0, V, (g,), device=device, generator=gen)
        p = torch.softmax(torch.randn(g, V, device=device, generator=gen), -1)

        def rule(logits):
            if sampling.greedy:
                return greedy_accept(drafts.tolist(), logits.argmax(-1).tolist())
            return accept_unchecked(p, sampling.probs(logits), drafts, gen)
        return rule

    verifier = _StepTimer(target, ids, gen)

    def cycles(one_cycle) -> list[dict]:
        one_cycle()  # warm-up
        return [one_cycle() | {"token": verifier.step(1, sample)} for _ in range(repeats)]

    def verify_cycle(g):
        return lambda: {"verify": verifier.step(g + 1, accept(g))}

    def lookup_cycle(seq, g):
        return lambda: {"lookup": _timed(lambda: prompt_lookup_propose(seq, g), device)[1:]}

    def draft_cycle(drafter, gamma):
        def one_cycle():
            steps = [drafter.step(1, sample) for _ in range(gamma)]
            return {"draft": tuple(sum(t[k] for t in steps) / gamma for k in (0, 1)),
                    "verify": verifier.step(gamma + 1, accept(gamma))}
        return one_cycle

    tokens, verify = [], {}
    for g in range(max(gammas) + 1):
        runs = cycles(verify_cycle(g))
        verify[g] = _median_ratios(runs)["verify"]
        tokens += [c["token"] for c in runs]
    costs = {"token": {k: statistics.median(t[i] for t in tokens) for i, k in enumerate(("wall", "cpu"))},
             "verify": verify}
    for name, draft in workload.drafters.items():
        if draft == "prompt_lookup":
            costs[name] = {g: _median_ratios(cycles(lookup_cycle(ids[0].tolist(), g)))["lookup"] for g in gammas}
        else:
            drafter = _StepTimer(draft, ids, gen)
            costs[name] = {g: _median_ratios(cycles(draft_cycle(drafter, g))) for g in gammas}
    return costs


@torch.inference_mode()
def measure_prefills(workload: Workload) -> dict:
    """Seconds of each prompt's prefill + first token, plain and with each drafter: what decode time excludes."""
    out, target, device = {}, workload.target, workload.target.device
    for i, prompt in enumerate(workload.prompts):
        out[("plain", i)] = _median_cost(partial(generate, target, [prompt], 1), device, 5)
        for name, draft in workload.drafters.items():
            out[(name, i)] = _median_cost(partial(speculative_generate, target, draft, prompt, 1, max_new_tokens=1),
                                          device, 5)
    return out


def _predict(costs: dict, clock: str, drafter: str, is_lookup: bool, proposed: list[int], alpha: float,
             gamma: int) -> dict:
    """The theory's speed-up from measured alpha and measured costs (see the module docstring)."""
    verify = {g: costs["verify"][g][clock] for g in costs["verify"]}
    tokens = statistics.fmean(expected_tokens_per_pass(alpha, g) for g in proposed)
    if is_lookup:
        lookup = costs[drafter][gamma][clock]         # one search per pass
        cost = statistics.fmean(lookup + verify[g] for g in proposed)
        c = lookup / gamma                            # per drafted token, for the paper formula
    else:
        c = costs[drafter][gamma]["draft"][clock]
        verify[gamma] = costs[drafter][gamma]["verify"][clock]  # in the loop's rhythm
        cost = statistics.fmean(g * c + verify[g] for g in proposed)
    return dict(predicted_speedup=tokens / cost, paper_speedup=expected_speedup(alpha, gamma, c),
                cost_ratio=c, verify_cost=verify[gamma], predicted_tokens_per_pass=tokens)


@dataclass
class _Run:
    """One timed generation: which prompt, how many tokens after the first, wall and CPU seconds."""

    prompt: int
    tokens: int
    wall: float
    cpu: float
    result: object = None


def _generation(workload: Workload, draft, i: int, gamma: int, temperature: float, seed: int) -> _Run:
    """Prompt i decoded plainly (draft None) or speculatively, timed on both clocks."""
    target, g = workload.target, torch.Generator(device=workload.target.device).manual_seed(seed)
    kw = dict(temperature=temperature, stop_tokens=workload.stop_tokens, generator=g)
    if draft is None:
        out, wall, cpu = _timed(lambda: generate(target, [workload.prompts[i]], workload.max_new_tokens, **kw),
                                target.device)
        return _Run(i, len(out.tokens[0]) - 1, wall, cpu)
    out, wall, cpu = _timed(lambda: speculative_generate(target, draft, workload.prompts[i], gamma,
                                                         max_new_tokens=workload.max_new_tokens, **kw), target.device)
    return _Run(i, out.num_generated - 1, wall, cpu, out)


def _decode_rate(runs: list[_Run], prefill: dict, who: str, clock: str) -> float:
    """Tokens after the first / (run time - its prefill) over a set of runs."""
    seconds = sum(getattr(r, clock) - prefill[(who, r.prompt)][clock] for r in runs)
    return sum(r.tokens for r in runs) / seconds


def acceptance(results, gamma: int) -> tuple[float, list]:
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
    tokens/s, prefill subtracted, on `clock` and on the wall), the prediction; plus the measured costs."""
    prefill = measure_prefills(workload)
    prompts = range(len(workload.prompts))
    costs, rows = {}, []
    for temperature in temperatures:
        costs[temperature] = measure_costs(workload, gammas, temperature)
        plain = []  # per repeat: plain runs (each prompt, before each drafter's sweep)
        spec = {}   # (drafter, gamma) -> per repeat: runs over the prompts
        for rep in range(repeats):
            plain.append([])
            for drafter, draft in workload.drafters.items():
                plain[-1] += [_generation(workload, None, i, 0, temperature, rep) for i in prompts]
                for gamma in gammas:
                    spec.setdefault((drafter, gamma), []).append(
                        [_generation(workload, draft, i, gamma, temperature, rep) for i in prompts])
        plain_rate = {c: [_decode_rate(runs, prefill, "plain", c) for runs in plain] for c in ("wall", "cpu")}
        for (drafter, gamma), reps in spec.items():
            results = [run.result for runs in reps for run in runs]
            alpha, by_position = acceptance(results, gamma)
            speedups = {c: [_decode_rate(runs, prefill, drafter, c) / base for runs, base in zip(reps, plain_rate[c])]
                        for c in ("wall", "cpu")}
            main = speedups[clock]
            passes = sum(r.target_forwards for r in results)
            row = dict(workload=workload.name, drafter=drafter, temperature=temperature, gamma=gamma,
                       alpha=alpha, acceptance_by_position=by_position,
                       tokens_per_pass=sum(r.num_generated - 1 for r in results) / passes,
                       measured_speedup=statistics.median(main), measured_speedup_min=min(main),
                       measured_speedup_max=max(main), measured_speedup_wall=statistics.median(speedups["wall"]),
                       plain_tok_per_s=statistics.median(plain_rate[clock]))
            row["spec_tok_per_s"] = row["plain_tok_per_s"] * row["measured_speedup"]
            row.update(_predict(costs[temperature], clock, drafter, workload.drafters[drafter] == "prompt_lookup",
                                [g for r in results for g in r.proposed], alpha, gamma))
            row["measured_over_predicted"] = row["measured_speedup"] / row["predicted_speedup"]
            rows.append(row)
    costs = {f"T={t:g}": c for t, c in costs.items()}  # JSON keys
    costs["prefill"] = {f"{name} prompt {i}": v for (name, i), v in prefill.items()}
    return rows, costs


def _print_table(rows: list[dict], clock: str) -> None:
    print_table(rows, [("workload", "workload", None), ("drafter", "drafter", None), ("temperature", "T", "{:g}"),
                       ("gamma", "gamma", None), ("alpha", "alpha", "{:.2f}"),
                       ("tokens_per_pass", "tok/pass", "{:.2f}"),
                       ("cost_ratio", "c", "{:.3f}"), ("verify_cost", "v", "{:.2f}"),
                       ("paper_speedup", "paper (v=1)", "{:.2f}"), ("predicted_speedup", "predicted", "{:.2f}"),
                       ("measured_speedup", f"measured ({clock})", "{:.2f}"), ("measured_speedup_min", "min", "{:.2f}"),
                       ("measured_speedup_max", "max", "{:.2f}"), ("measured_speedup_wall", "wall", "{:.2f}"),
                       ("measured_over_predicted", "meas/pred", "{:.2f}")])


def measure(run, workloads=None) -> dict:
    """Every workload (default: the toy pair's, and SmolLM2's where it is installed). Batch-1 decoding
    is latency work, so one thread (the package's policy; CS336_NUM_THREADS overrides); with one CPU
    thread the process's CPU time is the run's time on an idle core, however busy the shared machine
    is (wall-clock is reported beside it); with more threads wall-clock is the measure."""
    device, quick = run.device, run.quick
    clock = "cpu" if device.type == "cpu" and torch.get_num_threads() == 1 else "wall"
    gammas = (1, 4) if quick else tuple(range(1, 9))
    repeats = 1 if quick else 3
    t0 = time.perf_counter()
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


BENCHMARK = bench_speculative = Benchmark(
    "speculative", measure, lambda result: _print_table(result["rows"], result["clock"]),
    plots={"speculative": plot_speculative, "speculative_acceptance": plot_acceptance})
