"""`bench models`: the shipped models side by side: size, validation bits per byte, agreement with the
target, long-range recall against distance, training time (and curves, from the checkpoints' records).
"""

from __future__ import annotations

import math
import time

import matplotlib.pyplot as plt
import torch

from ...data.corpus import load_corpus
from ...data.evaluation import compare_to_reference, evaluate_lm, long_range_recall, recall_nll
from ...model import checkpoints
from ...shipped_models import EVAL
from ...tables import print_table
from .base import Benchmark

MODELS = ("target", "draft", "draft-scratch")
DISTANCES = (100, 150, 200, 300, 400)


def measure(run) -> dict:
    val = load_corpus("val")
    eval_kwargs = dict(EVAL, max_batches=2) if run.quick else EVAL
    trials = 8 if run.quick else 48
    names = [n for n in MODELS if n in checkpoints.available_pretrained()]
    if "target" not in names:
        raise FileNotFoundError("no shipped target model: run `python -m cs336_inference train --preset target`")
    models = {n: checkpoints.load_pretrained(n, device=run.device) for n in names}
    rows = {}
    for name, model in models.items():
        extra = checkpoints.load_extra(checkpoints.ASSETS / f"{name}.pt")
        t0 = time.perf_counter()
        metrics = evaluate_lm(model, val, **eval_kwargs)
        agreement = compare_to_reference(model, models["target"], val, **eval_kwargs)
        rows[name] = {
            "num_parameters": model.num_parameters(),
            "non_embedding_parameters": model.num_parameters(exclude_embeddings=True),
            # 2 x parameters touched per token (attention over the context, which grows with it, left out)
            "flops_per_token": 2 * model.num_parameters(exclude_embeddings=True),
            "file_bytes": (checkpoints.ASSETS / f"{name}.pt").stat().st_size, "config": model.config.to_dict(),
            "val_loss": metrics["loss"], "val_bits_per_byte": metrics["bits_per_byte"],
            "val_perplexity": metrics["perplexity"],
            "kl_to_target": agreement["kl"], "top1_agreement_with_target": agreement["top1_agreement"],
            "recall_by_distance": _str_keys(long_range_recall(model, DISTANCES, num_trials=trials, num_items=4)),
            "recall_nll_per_digit_by_distance": _str_keys(recall_nll(model, DISTANCES, num_trials=trials, num_items=4)),
            "train_time_s": extra.get("train_time_s"), "tokens_seen": extra.get("tokens_seen"),
            "method": extra.get("method"), "recorded_val_bits_per_byte": extra.get("val", {}).get("bits_per_byte"),
            "pruned_before_distill_bits_per_byte": extra.get("pruned_before_distill", {}).get("bits_per_byte"),
            "eval_seconds": time.perf_counter() - t0,
        }
    unigram = torch.bincount(val, minlength=257).double() / val.numel()
    unigram_bpb = float(-(unigram[unigram > 0] * unigram[unigram > 0].log2()).sum())
    return {"models": rows, "eval": eval_kwargs, "recall_trials": trials, "recall_num_items": 4,
            "recall_chance": 1e-3, "unigram_bits_per_byte": unigram_bpb,
            "note": "CPU, shared 2-core machine; recall = exact 3-digit greedy completion"}


def print_tables(result: dict) -> None:
    rows = result["models"]
    print_table([dict(r, model=name, recall=" ".join(f"{r['recall_by_distance'][str(d)]:.2f}" for d in DISTANCES),
                      nll=" ".join(f"{r['recall_nll_per_digit_by_distance'][str(d)]:.2f}" for d in DISTANCES))
                 for name, r in rows.items()],
                [("model", "model", None), ("num_parameters", "params", "{:,}"),
                 ("flops_per_token", "FLOPs/tok", lambda v: f"{v / 1e6:.2f}M"),
                 ("file_bytes", "file MB", lambda v: f"{v / 1e6:.2f}"), ("val_bits_per_byte", "val bpb", "{:.3f}"),
                 ("kl_to_target", "KL", "{:.3f}"), ("top1_agreement_with_target", "top1", "{:.3f}"),
                 ("train_time_s", "train s", "{:.0f}"), ("recall", "recall@" + ",".join(map(str, DISTANCES)), None),
                 ("nll", "nats/digit", None)])
    print(f"unigram baseline: {result['unigram_bits_per_byte']:.3f} bits/byte; recall chance 0.001 "
          "(ln 10 = 2.30 nats/digit)")


def _str_keys(by_distance: dict) -> dict:
    return {str(d): v for d, v in by_distance.items()}   # as the JSON holds them


def plot_loss_curves(result: dict):
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in result["models"]:
        hist = checkpoints.load_extra(checkpoints.ASSETS / f"{name}.pt").get("history")
        if not hist:
            continue
        line = ax.plot(hist["val_step"], hist["val_bpb"], marker="o", ms=3, label=f"{name} (val)")
        if result["models"][name]["method"] == "scratch":  # the draft's training loss is a KL, not comparable
            ax.plot(hist["step"], [loss / math.log(2) for loss in hist["train_loss"]], alpha=0.3,
                    color=line[0].get_color(), label=f"{name} (train)")
    ax.set(xlabel="step", ylabel="bits per byte", yscale="log", title="training curves")
    ax.legend(fontsize=8)
    return fig


def plot_recall(result: dict):
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (name, r) in enumerate(result["models"].items()):
        # coincident curves (all at 0 for these small models): wider lines drawn first stay visible beneath
        ax.plot(DISTANCES, [r["recall_by_distance"][str(d)] for d in DISTANCES], marker="o", lw=5 - 1.5 * i,
                ms=9 - 2 * i, label=name)
    ax.axhline(1e-3, color="grey", ls=":", label="chance (3 random digits)")
    ax.set(xlabel="distance from fact to query (tokens)", ylabel="exact recall accuracy",
           title="long-range recall probe (4 facts, greedy)", ylim=(-0.02, 1.02))
    ax.legend(fontsize=8)
    return fig


BENCHMARK = bench_models = Benchmark("models", measure, print_tables,
                                     plots={"models_loss_curves": plot_loss_curves, "models_recall": plot_recall})
