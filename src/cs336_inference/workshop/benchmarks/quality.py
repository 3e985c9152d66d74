"""`bench quality`: is the default path as right as fp32 on everyday questions, and do answers depend on
the batch?

SmolLM2-135M answers the everyday questions of `data.everyday_questions` greedily, asked alone, on three
paths loaded as `chat` loads them (`fast_path.load_for_inference`, eager decode): the default (int4-exact
weights, fp32 activations, our int4 kernel taking them as two bf16 halves), the fp32 reference, and the
old default's bf16 activations for contrast. Per path: answers with an expected word (right), answers
stuck in a repeated phrase (loops), and one row per question.

Then batch invariance on the serving engine: the first 16 questions served one at a time, then all 16
admitted together; how many answers differ (the default path and the old bf16 one, eagerly; the default
with `serve`'s compiled decode steps too, in a full run).
"""

from __future__ import annotations

import time

import matplotlib.pyplot as plt
import torch

from ...data.everyday_questions import QUESTIONS, answer, chat_prompt, grade, strip_stop
from ..fast_path import compiled_engine_decode, load_for_inference
from ...model.real_models import real_model_missing
from ...serving import Engine, Request, SamplingParams
from ...tables import print_table
from .base import Benchmark, grouped_bars

MODEL = "smollm2-135m"
# path name -> load_for_inference's precision and dtype
PATHS = {"default": (None, None), "fp32": ("fp32", None), "bf16 activations (old default)": (None, torch.bfloat16)}
BATCH = 16   # requests served alone, then together
RESULT = "quality_smollm2"   # figures/quality_smollm2.json and .png


def measure(run) -> dict | None:
    if missing := real_model_missing(MODEL):
        print(f"bench quality skipped: {missing}")
        return None
    run.name = RESULT
    questions = QUESTIONS[:8] if run.quick else QUESTIONS
    max_new = 24 if run.quick else 40
    batch = 4 if run.quick else BATCH
    paths, invariance = {}, []
    for name, (precision, dtype) in PATHS.items():
        model, tokenizer, banner = load_for_inference(MODEL, device=run.device, precision=precision, dtype=dtype)
        t0 = time.perf_counter()
        graded = grade(questions, answer(model, tokenizer, questions, max_new), tokenizer)
        paths[name] = dict(banner=banner, seconds=time.perf_counter() - t0, **graded)
        print(f"{name}: {graded['right']}/{len(questions)} right, {graded['loops']} loops", flush=True)
        if name != "fp32":
            invariance.append(batch_invariance(model, tokenizer, questions[:batch], max_new, name, decode=None))
            if name == "default" and not run.quick:
                decode, how = compiled_engine_decode(model)
                if decode is not None:
                    invariance.append(batch_invariance(model, tokenizer, questions[:batch], max_new,
                                                       f"{name}, {how.split(' (')[0]}", decode=decode))
        del model
    return dict(model=MODEL, questions=len(questions), max_new_tokens=max_new, paths=paths,
                batch_invariance=invariance,
                gate=dict(default_right=paths["default"]["right"], fp32_right=paths["fp32"]["right"],
                          passed=paths["default"]["right"] >= paths["fp32"]["right"]
                          and (paths["default"]["loops"] == 0 or paths["fp32"]["loops"] > 0)))


def serve_alone_and_together(model, tokenizer, questions, max_new: int, decode=None):
    """(answers served one request at a time, answers of all admitted together) on one engine, greedy."""
    engine = Engine(model, decode=decode)
    stop = tuple(tokenizer.stop_ids)
    params = SamplingParams(max_tokens=max_new, stop_token_ids=stop)
    requests = [Request(i, tuple(chat_prompt(tokenizer, q)), max_new, sampling=params) for i, q in enumerate(questions)]

    def serve(batch):
        return [strip_stop(list(r.tokens[0]), stop) for r in engine.run(batch).outputs]
    alone = [serve([r])[0] for r in requests]
    return alone, serve(requests)


def batch_invariance(model, tokenizer, questions, max_new: int, name: str, decode=None) -> dict:
    t0 = time.perf_counter()
    alone, together = serve_alone_and_together(model, tokenizer, questions, max_new, decode)
    differ = [i for i, (a, b) in enumerate(zip(alone, together)) if a != b]
    return dict(path=name, requests=len(questions), differ=len(differ), seconds=time.perf_counter() - t0,
                examples=[dict(prompt=questions[i].prompt, alone=tokenizer.decode(alone[i]),
                               together=tokenizer.decode(together[i])) for i in differ[:4]])


def print_quality(result: dict) -> None:
    names = list(result["paths"])
    print(f"\n{result['model']}: {result['questions']} everyday questions, greedy, up to {result['max_new_tokens']} "
          f"tokens, each asked alone")
    for name, p in result["paths"].items():
        print(f"  {name}: {p['banner']}")
    print_table([dict(path=n, right=p["right"], loops=p["loops"], seconds=p["seconds"])
                 for n, p in result["paths"].items()],
                [("path", "path", None), ("right", "right", None), ("loops", "loops", None),
                 ("seconds", "s", "{:.0f}")], title="right answers and loops")
    mark = lambda row: ("ok" if row["right"] else "--") + (" loop" if row["loop"] else "")   # noqa: E731
    rows = [dict(prompt=q["prompt"], **{n: mark(result["paths"][n]["questions"][i]) for n in names},
                 answer=result["paths"]["default"]["questions"][i]["answer"].replace("\n", " ")[:60])
            for i, q in enumerate(result["paths"]["default"]["questions"])]
    print_table(rows, [("prompt", "question", None)] + [(n, n.split(" (")[0], None) for n in names]
                + [("answer", "default's answer", None)], title="per question")
    gate = result["gate"]
    print(f"gate (default right >= fp32 right, no loops where fp32 has none): "
          f"{'passed' if gate['passed'] else 'FAILED'} ({gate['default_right']} vs {gate['fp32_right']})")
    print_table(result["batch_invariance"], [("path", "path", None), ("requests", "requests", None),
                                             ("differ", "answers that differ alone vs together", None)],
                title="batch invariance on the serving engine")
    for inv in result["batch_invariance"]:
        for ex in inv["examples"]:
            print(f"  {inv['path']}: {ex['prompt']!r}: alone {ex['alone'][:50]!r}, together {ex['together'][:50]!r}")


def plot_quality(result: dict):
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw=dict(width_ratios=[3, 2]))
    names = list(result["paths"])
    series = {"right": [result["paths"][n]["right"] for n in names],
              "loops": [result["paths"][n]["loops"] for n in names]}
    for bars in grouped_bars(ax, names, series):
        ax.bar_label(bars, fontsize=8)
    ax.axhline(result["questions"], color="gray", lw=0.8, ls=":")
    ax.set(ylabel="answers", title=f"{result['model']}: {result['questions']} everyday questions, greedy")
    ax.legend()
    inv = result["batch_invariance"]
    bars = bx.bar(range(len(inv)), [i["differ"] for i in inv], color="tab:red")
    bx.bar_label(bars, fontsize=8)
    bx.set_xticks(range(len(inv)), [i["path"].replace(", ", ",\n") for i in inv], fontsize=7)
    bx.set(ylabel=f"answers that differ (of {inv[0]['requests'] if inv else 0})",
           title="alone vs batched on the engine")
    bx.set_ylim(0, max([1] + [i["requests"] for i in inv]))
    fig.tight_layout()
    return fig


BENCHMARK = Benchmark("quality", measure, print_quality, parallel=True, plots={"{name}": plot_quality},
                      results=(RESULT,))
