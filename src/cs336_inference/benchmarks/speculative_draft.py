"""`bench speculative_draft`: a draft for SmolLM2-135M, pruned and distilled on a CPU time budget.

Minitron-style (`compression.prune_model` + `distill`): keep the most important layers and MLP
channels, then distil the full model into the cut one for `minutes` of CPU training on offline text
(CPython's help pages, plain and as the chat tasks `bench speculative` runs). Reports alpha on the
grounded chat prompts (greedy, gamma = 4) before and after, the measured cost ratio c and the
predicted speed-up. A draft must keep SmolLM2's whole tied 49152 x 576 embedding (28M of its 135M
parameters), so even a few layers cost a sizeable fraction of the target.
"""

from __future__ import annotations

import time

import torch

from ..compression import distill, importance_scores, prune_model
from ..data.real_text import prose_paragraphs
from ..data.training import TrainConfig
from ..generation.speculative import speculative_generate
from ..generation.speculative_costs import measure_costs
from ..generation.speculative_theory import expected_speedup, optimal_gamma
from ..model.tokenizer import load_tokenizer
from .base import Benchmark
from .speculative import REAL_TASKS, pooled, real_workloads

DRAFT_SHAPE = dict(num_layers=8, d_ff=1024)  # of 30 layers and d_ff 1536; d_model and heads kept
GAMMA = 4


def _training_text(tok, held_out: set[str]) -> torch.Tensor:
    """One token stream: every help-page paragraph as plain text, and each prose paragraph as a chat
    task answered by copying it (what the target does); the benchmark's prompts are held out."""
    from pydoc_data.topics import topics

    pieces = []
    for name in sorted(topics):
        for par in topics[name].split("\n\n"):
            if par.strip() and " ".join(par.split()) not in held_out:
                pieces.append(tok.encode(par) + tok.stop_ids[-1:])
    for i, par in enumerate(prose_paragraphs()):
        if par in held_out:
            continue
        chat = tok.apply_chat_template([{"role": "user", "content": REAL_TASKS[i % 2] + par}])
        pieces.append(tok.encode(chat + par) + tok.stop_ids[:1])
    return torch.tensor([t for p in pieces for t in p])


@torch.inference_mode()
def _acceptance(target, draft, prompts, stop, new: int = 64):
    """Pooled acceptance over `prompts` (greedy, gamma GAMMA): a result with `alpha`, `acceptance_by_position`."""
    return pooled([speculative_generate(target, draft, p, GAMMA, max_new_tokens=new, stop_tokens=stop)
                   for p in prompts], GAMMA)


def measure(run, minutes: float = 30.0) -> dict | None:
    device, quick = run.device, run.quick
    workloads = [w for w in real_workloads(device, quick) if w.name == "smollm2-grounded"]
    if not workloads:
        print("bench speculative_draft needs the real model (SmolLM2-135M); nothing to do")
        return None
    w, tok = workloads[0], load_tokenizer("smollm2-135m")
    target, prompts = w.target, w.prompts
    minutes = 1.0 if quick else minutes
    held_out = {par for par in prose_paragraphs() if any(par in tok.decode(p) for p in prompts)}
    stream = _training_text(tok, held_out)
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
    probe = prune_model(target, calibration, scores=scores, **DRAFT_SHAPE)
    t0 = time.perf_counter()
    distill(probe, target, cfg, train_data=train, val_data=val)
    step_s = (time.perf_counter() - t0) / 2
    steps = max(2, int(minutes * 60 / step_s))
    print(f"distillation: {step_s:.1f} s per step -> {steps} steps in {minutes:g} minutes", flush=True)
    t0 = time.perf_counter()
    _, history = distill(draft, target, cfg.replace(steps=steps, warmup_steps=min(20, steps // 10 + 1),
                                                    eval_every=max(1, steps // 4), eval_batches=2),
                         train_data=train, val_data=val)
    train_minutes = (time.perf_counter() - t0) / 60
    draft.eval()
    passes = _acceptance(target, draft, prompts, w.stop_tokens)
    alpha, by_position = passes.alpha, passes.acceptance_by_position
    c = measure_costs(target, {"draft": draft}, prompts[0], (GAMMA,), repeats=10)["draft"][GAMMA]["draft"]["wall"]
    best = optimal_gamma(alpha, c, max_gamma=16)
    return dict(device=str(device), threads=torch.get_num_threads(), draft_shape=DRAFT_SHAPE,
                draft_parameters=draft.num_parameters(), target_parameters=target.num_parameters(),
                train_tokens=len(train), steps=steps, step_seconds=step_s, train_minutes=train_minutes,
                history={k: v for k, v in history.items() if isinstance(v, list)},
                alpha_pruned=alpha_pruned, alpha_distilled=alpha, acceptance_by_position=by_position,
                cost_ratio=c, best_gamma=best, predicted_speedup=expected_speedup(alpha, best, c),
                used_in_bench_speculative=alpha >= 0.5)


def print_result(r: dict) -> None:
    print(f"alpha: pruned {r['alpha_pruned']:.2f} -> distilled {r['alpha_distilled']:.2f} after {r['steps']} steps "
          f"({r['train_minutes']:.0f} min); c = {r['cost_ratio']:.2f}; best gamma {r['best_gamma']}: predicted "
          f"speed-up {r['predicted_speedup']:.2f}x")


BENCHMARK = bench_speculative_draft = Benchmark("speculative_draft", measure, print_result, parallel=True)
