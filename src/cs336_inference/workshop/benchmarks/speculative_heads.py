"""`bench speculative_heads`: train Medusa heads and an EAGLE draft for SmolLM2 by self-distillation.

The target continues offline prompts greedily (`generation.draft_training.self_distillation_data`):
chat tasks that rewrite or summarise CPython help paragraphs and standard-library docstrings, help pages
to continue as plain text, and short stories on given subjects; the paragraphs and subject that
`bench speculative` decodes are held out. Then the heads and the draft train on its features and
choices, each on a CPU time budget. Generating the data takes about half of the run's 25 minutes: up to
this size more data raised the drafts' acceptance, but ten times as much barely does (docs/log.md). Writes
figures/speculative_heads.json (the timings: wall and process CPU seconds per phase, the loss curves)
and, unless --quick, the assets medusa-smollm2.pt and eagle-smollm2.pt.
"""

from __future__ import annotations

import time

import torch

from ...data.real_text import docstring_paragraphs, pydoc_documents, prose_paragraphs
from ...generation.draft_heads import ASSETS, SHIPPED, save_draft_heads
from ...generation.draft_training import DistillData, self_distillation_data, train_eagle, train_medusa
from ...model.checkpoints import load_pretrained
from ...model.real_models import real_model_missing
from ...model.tokenizer import load_tokenizer
from .base import Benchmark

MODEL = "smollm2-135m"
NUM_HEADS = 4
HELD_OUT_EVERY = 5    # prose paragraph i is held out iff i % 5 == 1 (`bench speculative` uses 1, 6, ...)
TASKS = ("Rewrite the following passage, putting each sentence on its own line:\n\n",
         "Summarize the following passage:\n\n")
SUBJECTS = ("a baker who wakes up with the ability to hear bread", "two robots learning to play chess",
            "a cat who runs a small library", "a girl who builds a boat from old doors",
            "a dragon afraid of the dark", "a detective who solves crimes with smells",
            "a village where it never stops snowing", "a clockmaker and a broken moon",
            "a boy who trades his shadow for a kite", "an astronaut who grows a garden on Mars",
            "a musician who can only play one note", "a fox and a crow opening a bakery",
            "a painter who loses all her colours", "a tortoise who wants to win a race again",
            "a robot that collects lost socks", "a city where everyone whispers", "a pirate who is afraid of water",
            "an owl who cannot stay awake at night", "a girl who talks to trees",
            "a broken umbrella that wants to fly", "a chef who cooks only soup", "a mouse who becomes a king",
            "a train that runs on songs", "a teacher who finds a door in the classroom",
            "a snowman who wants to see summer", "a boy and his grandfather fixing a radio",
            "a whale who sings off key", "a small town with a giant clock", "a knight who hates fighting",
            "a garden that grows at night", "two friends lost in a museum", "a bear who opens a tea shop",
            "a scientist who shrinks herself", "a river that changes direction", "a kite that refuses to come down",
            "a farmer and a talking goat")
HELD_OUT_SUBJECT = "a lighthouse keeper who finds a message in a bottle"   # `bench speculative`'s free prompt


def chat_ids(tok, text: str) -> list[int]:
    """The token ids of `text` as one user turn under the model's chat template."""
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def held_out_paragraphs() -> list[str]:
    """The help paragraphs no draft trains on: i % HELD_OUT_EVERY == 1, each text once, in order."""
    return list(dict.fromkeys(par for i, par in enumerate(prose_paragraphs()) if i % HELD_OUT_EVERY == 1))


def training_prompts(tok) -> list[list[int]]:
    """Chat prompts and plain help-page openings: both tasks (rewrite, summarise) on every help paragraph
    not held out, one task on each standard-library docstring paragraph, a story on each subject."""
    held_out = set(held_out_paragraphs())
    # the help repeats some paragraphs under several topics: a repeat of a held-out one is held out too
    kept = list(dict.fromkeys(par for par in prose_paragraphs() if par not in held_out))
    prompts = [chat_ids(tok, task + par) for par in kept for task in TASKS]
    prompts += [chat_ids(tok, f"Write a short story about {s}.") for s in SUBJECTS]
    prompts += [tok.encode(doc)[:96] for doc in pydoc_documents("calibration")[::4]]
    prompts += [chat_ids(tok, TASKS[i % 2] + par) for i, par in enumerate(docstring_paragraphs())]
    return prompts


def split(data: DistillData, every: int = 10) -> tuple[DistillData, DistillData]:
    """(training sequences, every `every`-th sequence held out: the last one at least, when fewer)."""
    every = min(every, len(data.tokens))   # a --quick run's 8 sequences still keep one to early-stop on
    pick = [[x for i, x in enumerate(part) if (i % every == every - 1) == held] for held in (False, True)
            for part in (data.tokens, data.features, data.labels)]
    return DistillData(*pick[:3]), DistillData(*pick[3:])


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def measure(run, minutes: float = 26.0) -> dict | None:
    """Data, then Medusa heads, then the EAGLE draft, on about `minutes` of wall time in all."""
    if missing := real_model_missing(MODEL):
        print(f"bench speculative_heads needs {MODEL} ({missing}); nothing to do")
        return None
    quick, device = run.quick, run.device
    target, tok = load_pretrained(MODEL, device=device).eval(), load_tokenizer(MODEL)
    prompts = training_prompts(tok)
    if quick:
        prompts, minutes = prompts[:8], 1.0
    phases = {}
    w0, c0 = _clocks()
    new_tokens = 32 if quick else 96
    print(f"self-distillation data: {len(prompts)} prompts, {new_tokens} greedy tokens each", flush=True)
    data = self_distillation_data(target, prompts, new_tokens, batch_size=16, stop_tokens=tok.stop_ids)
    w1, c1 = _clocks()
    phases["data"] = dict(wall_s=w1 - w0, cpu_s=c1 - c0, tokens=data.num_tokens, sequences=len(data.tokens),
                          vocabulary_used=len(data.vocabulary()))
    data, val = split(data)   # every 10th sequence is held out: early stopping keeps the best heads on it
    budget = max(480.0, minutes * 60 - (w1 - w0))   # what is left, split between the two
    print(f"  {data.num_tokens} tokens in {w1 - w0:.0f} s; training budget {budget:.0f} s", flush=True)
    heads, medusa_history = train_medusa(target, data, NUM_HEADS, steps=20 if quick else 1500,
                                         time_budget_s=0.35 * budget, val=val)
    w2, c2 = _clocks()
    phases["medusa"] = dict(wall_s=w2 - w1, cpu_s=c2 - c1, steps=medusa_history["steps_run"],
                            parameters=sum(p.numel() for p in heads.parameters()))
    draft, eagle_history = train_eagle(target, data, steps=20 if quick else 4000, time_budget_s=0.65 * budget,
                                       val=val)
    w3, c3 = _clocks()
    phases["eagle"] = dict(wall_s=w3 - w2, cpu_s=c3 - c2, steps=eagle_history["steps_run"],
                           parameters=sum(p.numel() for p in draft.parameters()))
    meta = dict(target=MODEL, prompts=len(prompts), tokens=data.num_tokens)
    if not quick:
        ASSETS.mkdir(exist_ok=True)
        save_draft_heads(ASSETS / SHIPPED["medusa-smollm2"], heads, meta | dict(steps=phases["medusa"]["steps"]))
        save_draft_heads(ASSETS / SHIPPED["eagle-smollm2"], draft, meta | dict(steps=phases["eagle"]["steps"]))
        print(f"wrote {ASSETS / SHIPPED['medusa-smollm2']} and {ASSETS / SHIPPED['eagle-smollm2']}")
    return dict(model=MODEL, device=str(device), threads=torch.get_num_threads(), num_heads=NUM_HEADS,
                prompts=len(prompts), new_tokens=new_tokens, phases=phases,
                total_wall_s=w3 - w0, total_cpu_s=c3 - c0, medusa_history=medusa_history,
                eagle_history=eagle_history)


def print_heads(r: dict) -> None:
    for name, p in r["phases"].items():
        print(f"{name:7s} wall {p['wall_s']:7.0f} s  CPU {p['cpu_s']:7.0f} s  "
              + ", ".join(f"{k} {v}" for k, v in p.items() if k not in ("wall_s", "cpu_s")))
    print(f"total   wall {r['total_wall_s']:7.0f} s  CPU {r['total_cpu_s']:7.0f} s ({r['threads']} threads)")


# Every core: the training budget is half an hour on two, and generating and training run 1.5-1.9x
# faster on two threads than on one (with OpenMP's passive wait policy, which `python -m cs336_inference`
# sets); the CPU seconds reported are then both threads'.
BENCHMARK = bench_speculative_heads = Benchmark("speculative_heads", measure, print_heads, parallel=True)
