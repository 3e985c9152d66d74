"""`python -m cs336_inference bench models`: the shipped models side by side.

Writes figures/models.json (size, validation bits per byte, KL and top-1 agreement to the target,
long-range recall vs distance, training time) and two figures: the training curves
(figures/models_loss_curves.png) and recall accuracy vs distance (figures/models_recall.png).
"""

from __future__ import annotations

import time

import torch

from ..model import checkpoints
from ..data.corpus import load_corpus
from ..data.evaluation import compare_to_reference, evaluate_lm, long_range_recall, recall_nll
from ..figures import save_figure, save_json
from ..shipped_models import EVAL
from ..tables import print_table

MODELS = ("target", "draft", "draft-scratch")
DISTANCES = (100, 150, 200, 300, 400)


def flops_per_token(model) -> int:
    """2 x (parameters touched per token): every matrix but the embedding lookup (attention over the
    context is extra and grows with it; it is left out so the number is a per-token constant)."""
    return 2 * model.num_parameters(exclude_embeddings=True)


def bench_models(quick: bool = False, device: str | None = None) -> dict:
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is as fast and immune to a busy shared CPU
    try:
        return _bench_models(quick, device)
    finally:
        torch.set_num_threads(previous_threads)


def _bench_models(quick: bool, device: str | None) -> dict:
    torch.manual_seed(0)
    val = load_corpus("val")
    eval_kwargs = dict(EVAL, max_batches=2) if quick else EVAL
    trials = 8 if quick else 48
    names = [n for n in MODELS if n in checkpoints.available_pretrained()]
    if "target" not in names:
        raise FileNotFoundError("no shipped target model: run `python -m cs336_inference train --preset target`")
    models = {n: checkpoints.load_pretrained(n, device=device) for n in names}
    target = models["target"]
    rows = {}
    for name, model in models.items():
        extra = checkpoints.load_extra(checkpoints.ASSETS / f"{name}.pt")
        t0 = time.perf_counter()
        metrics = evaluate_lm(model, val, **eval_kwargs)
        agreement = compare_to_reference(model, target, val, **eval_kwargs)
        recall = long_range_recall(model, DISTANCES, num_trials=trials, seed=0, num_items=4)
        nll = recall_nll(model, DISTANCES, num_trials=trials, seed=0, num_items=4)
        rows[name] = {
            "num_parameters": model.num_parameters(),
            "non_embedding_parameters": model.num_parameters(exclude_embeddings=True),
            "flops_per_token": flops_per_token(model),
            "file_bytes": (checkpoints.ASSETS / f"{name}.pt").stat().st_size,
            "config": model.config.to_dict(),
            "val_loss": metrics["loss"], "val_bits_per_byte": metrics["bits_per_byte"],
            "val_perplexity": metrics["perplexity"],
            "kl_to_target": agreement["kl"], "top1_agreement_with_target": agreement["top1_agreement"],
            "recall_by_distance": recall, "recall_nll_per_digit_by_distance": nll,
            "train_time_s": extra.get("train_time_s"), "tokens_seen": extra.get("tokens_seen"),
            "method": extra.get("method"), "recorded_val_bits_per_byte": extra.get("val", {}).get("bits_per_byte"),
            "pruned_before_distill_bits_per_byte": extra.get("pruned_before_distill", {}).get("bits_per_byte"),
            "eval_seconds": time.perf_counter() - t0,
        }
    unigram = torch.bincount(val, minlength=257).double() / val.numel()
    unigram_bpb = float(-(unigram[unigram > 0] * unigram[unigram > 0].log2()).sum())
    result = {"models": rows, "eval": eval_kwargs, "recall_trials": trials, "recall_num_items": 4,
              "recall_chance": 1e-3, "unigram_bits_per_byte": unigram_bpb, "quick": quick,
              "note": "CPU, shared 2-core machine; recall = exact 3-digit greedy completion"}

    print_table([dict(r, model=name, recall=" ".join(f"{r['recall_by_distance'][d]:.2f}" for d in DISTANCES),
                      nll=" ".join(f"{r['recall_nll_per_digit_by_distance'][d]:.2f}" for d in DISTANCES))
                 for name, r in rows.items()],
                [("model", "model", None), ("num_parameters", "params", "{:,}"),
                 ("flops_per_token", "FLOPs/tok", lambda v: f"{v / 1e6:.2f}M"),
                 ("file_bytes", "file MB", lambda v: f"{v / 1e6:.2f}"), ("val_bits_per_byte", "val bpb", "{:.3f}"),
                 ("kl_to_target", "KL", "{:.3f}"), ("top1_agreement_with_target", "top1", "{:.3f}"),
                 ("train_time_s", "train s", "{:.0f}"), ("recall", "recall@" + ",".join(map(str, DISTANCES)), None),
                 ("nll", "nats/digit", None)])
    print(f"unigram baseline: {unigram_bpb:.3f} bits/byte; recall chance 0.001 (ln 10 = 2.30 nats/digit)")
    save_json(result, "models", result=True, quick=quick)
    _plot(models, rows, quick)
    return result


def _plot(models, rows, quick: bool) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in rows:
        extra = checkpoints.load_extra(checkpoints.ASSETS / f"{name}.pt")
        hist = extra.get("history")
        if not hist:
            continue
        line = ax.plot(hist["val_step"], hist["val_bpb"], marker="o", ms=3, label=f"{name} (val)")
        if extra.get("method") == "scratch":  # the draft's training loss is a KL, not comparable
            bpb = [loss / 0.6931471805599453 for loss in hist["train_loss"]]
            ax.plot(hist["step"], bpb, alpha=0.3, color=line[0].get_color(), label=f"{name} (train)")
    ax.set(xlabel="step", ylabel="bits per byte", yscale="log", title="training curves")
    ax.legend(fontsize=8)
    save_figure(fig, "models_loss_curves", result=True, quick=quick)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in rows.items():
        d = sorted(r["recall_by_distance"])
        ax.plot(d, [r["recall_by_distance"][k] for k in d], marker="o", label=name)
    ax.axhline(1e-3, color="grey", ls=":", label="chance (3 random digits)")
    ax.set(xlabel="distance from fact to query (tokens)", ylabel="exact recall accuracy",
           title="long-range recall probe (4 facts, greedy)", ylim=(-0.02, 1.02))
    ax.legend(fontsize=8)
    save_figure(fig, "models_recall", result=True, quick=quick)
    plt.close(fig)
