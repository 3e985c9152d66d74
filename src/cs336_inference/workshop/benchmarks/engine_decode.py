"""`bench engine_decode`: the serving engine's decode steps, eager and compiled, as `serve` runs them.

SmolLM2-135M loaded the way `serve` loads it (`fast_path.load_for_inference`: the published int4 blocks,
the CPU tuning, every core). B greedy requests on real prompts, admitted together, each decoding
`new_tokens` tokens: the engine eagerly (`serve --no-compile`) and with `compiled_engine_decode`
(`serve`'s default: compiled blocks), alternated round by round. A step's time is its `StepRecord` span (schedule, run,
sample, postprocess) over the steps that only decode; tokens/s = B / that time. `same_tokens` records
whether the two gave the same greedy tokens (both compute in bf16 and round differently, so they can part),
and `partings` where and how close to a tie they part.
"""

from __future__ import annotations

import statistics
import time
from functools import partial

import matplotlib.pyplot as plt
import torch

from ...data.real_text import eval_text_tokens
from ..fast_path import compiled_engine_decode, load_for_inference
from ...model.real_models import real_model_missing
from ...serving import Engine, Request, SamplingParams
from ...tables import print_table
from .base import Benchmark, alternate, grouped_bars, spread

MODEL = "smollm2-135m"
PROMPT_LEN = 48


def measure(run) -> dict | None:
    if missing := real_model_missing(MODEL):
        print(f"bench engine_decode skipped: {missing}")
        return None
    model, _, banner = load_for_inference(MODEL, device=run.device)
    decode, how = compiled_engine_decode(model)
    if decode is None:
        print(f"bench engine_decode skipped: {how}")
        return None
    batch_sizes, new_tokens = ((1, 4), 16) if run.quick else ((1, 4, 16), 64)
    engines = {"eager": Engine(model), "compiled": Engine(model, decode=decode)}
    t0 = time.perf_counter()
    engines["compiled"].warm_up()                      # both graphs (one sequence, several), as `serve` does
    compile_seconds = time.perf_counter() - t0
    text = eval_text_tokens(MODEL, PROMPT_LEN * max(batch_sizes)).view(-1, PROMPT_LEN).tolist()
    tokens = {}

    def one(name: str, B: int) -> float:
        requests = [Request(i, tuple(text[i]), new_tokens, sampling=SamplingParams(max_tokens=new_tokens))
                    for i in range(B)]
        result = engines[name].run(requests)
        tokens.setdefault(B, {})[name] = [r.tokens[0] for r in result.outputs]   # one sample each
        return statistics.median(s.end - s.start for s in result.steps if s.num_prefills == 0)

    rounds = 2 if run.quick else 5
    times = alternate({(name, B): partial(one, name, B) for B in batch_sizes for name in engines}, rounds)
    rows = []
    for (name, B), ts in times.items():
        ms, ms_min, ms_max = spread(ts, 1e3)
        rows.append(dict(engine=name, batch=B, ms_per_step=ms, ms_min=ms_min, ms_max=ms_max, tok_per_s=1e3 * B / ms))
    for row in rows:
        eager = next(r for r in rows if r["engine"] == "eager" and r["batch"] == row["batch"])
        row["speedup_vs_eager"] = eager["ms_per_step"] / row["ms_per_step"]
    return dict(model=MODEL, banner=banner, compiled=how, compile_seconds=compile_seconds, prompt_len=PROMPT_LEN,
                new_tokens=new_tokens, rounds=rounds, rows=rows,
                same_tokens=all(t["eager"] == t["compiled"] for t in tokens.values()),
                partings=partings(model, text, tokens))


def partings(model, text, tokens) -> list[dict]:
    """Where a compiled answer first leaves the eager one: the position, and the gap between the two
    chosen tokens' logits in a full forward (no cache) over the prompt and the eager answer so far;
    near zero means a near-tie that bf16 rounding can flip, not a wrong step."""
    found = []
    for B, by_engine in tokens.items():
        for i, (eager, compiled) in enumerate(zip(by_engine["eager"], by_engine["compiled"])):
            if eager == compiled:
                continue
            at = next(j for j, (a, b) in enumerate(zip(eager, compiled)) if a != b)
            with torch.no_grad():
                logits = model(torch.tensor([text[i] + list(eager[:at])]))[0, -1].float()
            found.append(dict(batch=B, request=i, position=at,
                              logit_gap=abs(float(logits[eager[at]] - logits[compiled[at]])),
                              both_top2=set(logits.topk(2).indices.tolist()) == {eager[at], compiled[at]}))
    return found


def print_engine_decode(result: dict) -> None:
    print(f"\n{result['banner']}\n{result['compiled']}: warm-up (compiling) {result['compile_seconds']:.0f} s; "
          f"{result['new_tokens']} new tokens per request after {result['prompt_len']}-token prompts; "
          f"same tokens eager and compiled: {result['same_tokens']}")
    if parted := result.get("partings"):
        gaps = [p["logit_gap"] for p in parted]
        print(f"{len(parted)} answers part from the eager ones; where they part, the two tokens' logits differ by "
              f"{min(gaps):.3f}-{max(gaps):.3f} in a full forward, and are its top 2 in "
              f"{sum(p['both_top2'] for p in parted)} of them")
    print_table([dict(r, spread=f"{r['ms_min']:.1f}-{r['ms_max']:.1f}") for r in result["rows"]], [
        ("engine", "engine", None), ("batch", "B", None), ("ms_per_step", "ms/step", "{:.1f}"),
        ("spread", "min-max", None), ("tok_per_s", "tok/s", "{:.0f}"), ("speedup_vs_eager", "vs eager", "{:.2f}x")])


def plot_engine_decode(result: dict):
    fig, ax = plt.subplots(figsize=(7, 4))
    batches = sorted({r["batch"] for r in result["rows"]})
    series = {name: [next(r["tok_per_s"] for r in result["rows"] if r["engine"] == name and r["batch"] == B)
                     for B in batches] for name in ("eager", "compiled")}
    for bars in grouped_bars(ax, [f"B={B}" for B in batches], series):
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set(ylabel="decode tokens/s (all requests)", title=f"{result['model']}: the serving engine's decode steps")
    ax.legend()
    fig.tight_layout()
    return fig


BENCHMARK = Benchmark("engine_decode", measure, print_engine_decode, parallel=True,
                      plots={"engine_decode": plot_engine_decode})
