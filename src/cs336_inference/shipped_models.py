"""How each shipped model is made: `python -m cs336_inference train --preset NAME`.

  target         trained from scratch on the offline corpus (next-token loss)
  draft          the target, Minitron-pruned to the "draft" shape and repaired by distillation
  draft-scratch  the same "draft" shape trained from scratch with the same data and steps

Runs are deterministic (seeded, one CPU thread, so MKL reductions happen in a fixed order): on the
same torch build the command reproduces the shipped weights. Each file stores its recorded
validation metrics, measured on the bf16 weights exactly as `load_pretrained` returns them.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import _checks
from .model import checkpoints
from .model.config import ModelConfig
from .data.corpus import build_corpus, load_corpus
from .data.evaluation import evaluate_lm
from .data.training import TrainConfig, train_lm

# Validation settings behind the recorded numbers (the full one for reports, the quick one for tests).
EVAL = dict(seq_len=512, batch_size=8, max_batches=8)
QUICK_EVAL = dict(seq_len=256, batch_size=4, max_batches=2)
SAVE_DTYPE = torch.bfloat16
DRAFT_STEPS = 400

TRAIN_PRESETS: dict[str, dict] = {
    "target": dict(model="target", method="scratch",
                   train=TrainConfig(steps=800, batch_size=4, seq_len=512, lr=3e-3, warmup_steps=30,
                                     eval_every=50, eval_batches=2, seed=0, num_threads=1)),
    "draft": dict(model="draft", method="prune+distill", teacher="target", calibration_samples=32,
                  distill_alpha=1.0, distill_temperature=1.0,
                  train=TrainConfig(steps=DRAFT_STEPS, batch_size=4, seq_len=512, lr=3e-3, warmup_steps=20,
                                    eval_every=50, eval_batches=2, seed=1, num_threads=1)),
    "draft-scratch": dict(model="draft", method="scratch",
                          train=TrainConfig(steps=DRAFT_STEPS, batch_size=4, seq_len=512, lr=3e-3,
                                            warmup_steps=20, eval_every=50, eval_batches=2, seed=1,
                                            num_threads=1)),
}


def get_train_preset(name: str) -> dict:
    if name not in TRAIN_PRESETS:
        raise ValueError(f"unknown training preset {name!r}; available: {sorted(TRAIN_PRESETS)}")
    return TRAIN_PRESETS[name]


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def output_path(name: str, out: str | Path | None = None) -> Path:
    """Where `train_preset` writes, checked before any training: `out`, or a new file
    ./trained/NAME.pt (NAME-2.pt, ... when taken). The shipped models in assets/ are replaced only
    when `out` names one of them explicitly."""
    get_train_preset(name)
    if out is None:
        path, i = Path.cwd() / "trained" / f"{name}.pt", 2
        while path.exists():
            path, i = path.with_name(f"{name}-{i}.pt"), i + 1
    else:
        path = Path(_checks.instance("out", out, (str, Path), "a file path (str or Path)"))
    if path.is_dir():
        raise ValueError(f"out={str(out)!r} is a directory; give a file path, e.g. {path / (name + '.pt')}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"out={str(out)!r}: cannot create the folder {path.parent} ({e.strerror})") from None
    if not os.access(path.parent, os.W_OK):
        raise ValueError(f"out={str(out)!r}: the folder {path.parent} is not writable")
    return path


def train_preset(name: str, out: str | Path | None = None, steps: int | None = None, device=None,
                 progress: bool = True) -> tuple[torch.nn.Module, dict]:
    """Make the model of preset `name` and save it to `output_path(name, out)` (default: a new file
    under ./trained/; pass out=ASSETS / "NAME.pt" to replace a shipped model).

    steps overrides the preset (for a quick smoke run; the result is then not the shipped model).
    Returns (model as loaded back from the saved bf16 file, the stored `extra` metadata).
    """
    spec = get_train_preset(name)
    out = output_path(name, out)  # a bad path fails now, not after training
    train_cfg = spec["train"].replace(progress=progress, device=device)
    if steps is not None:
        train_cfg = train_cfg.replace(steps=steps, eval_every=min(train_cfg.eval_every, steps))
    model_cfg = ModelConfig.from_name(spec["model"])
    previous_threads = torch.get_num_threads()
    t0 = time.perf_counter()
    extra: dict = {}
    try:
        if spec["method"] == "scratch":
            model, history = train_lm(model_cfg, train_cfg, desc=name)
        else:
            from .compression.pruning import distill, prune_model  # pruning imports train: keep the import local

            teacher = checkpoints.load_pretrained(spec["teacher"], device=device)
            calibration = load_corpus("train", train_cfg.data_seed)[: spec["calibration_samples"] * 513]
            calibration = calibration.view(spec["calibration_samples"], 513)
            if train_cfg.num_threads is not None:
                torch.set_num_threads(train_cfg.num_threads)
            student = prune_model(teacher, calibration, num_layers=model_cfg.num_layers,
                                  num_kv_heads=model_cfg.num_kv_heads, num_heads=model_cfg.num_heads,
                                  d_ff=model_cfg.d_ff)
            if student.config != model_cfg:
                raise RuntimeError(f"pruning gave {student.config}, expected the preset {model_cfg}")
            extra["pruned_from"] = student.pruned_from
            extra["pruned_before_distill"] = evaluate_lm(student, load_corpus("val", train_cfg.data_seed), **EVAL)
            model, history = distill(student, teacher, train_cfg, alpha=spec["distill_alpha"],
                                     temperature=spec["distill_temperature"], desc=name)
    finally:
        torch.set_num_threads(previous_threads)
    wall = time.perf_counter() - t0

    checkpoints.save(out, model, dtype=SAVE_DTYPE)  # round to bf16 first: record what ships
    shipped = checkpoints.load(out)
    val = load_corpus("val", train_cfg.data_seed)
    extra.update({
        "name": name, "method": spec["method"], "teacher": spec.get("teacher"),
        "model_config": model_cfg.to_dict(), "train_config": train_cfg.to_dict(),
        "num_parameters": shipped.num_parameters(), "saved_dtype": str(SAVE_DTYPE),
        "val": evaluate_lm(shipped, val, **EVAL), "val_eval": EVAL,
        "val_quick": evaluate_lm(shipped, val, **QUICK_EVAL), "val_quick_eval": QUICK_EVAL,
        "train_time_s": history["train_time_s"], "wall_time_s": wall, "tokens_seen": history["tokens_seen"],
        "history": {k: history[k] for k in ("step", "train_loss", "lr", "val_step", "val_loss", "val_bpb")},
        "corpus_sha256": hashlib.sha256(build_corpus(train_cfg.data_seed)).hexdigest(),
        "command": f"python -m cs336_inference train --preset {name}",
        "git_commit": _git_commit(), "torch": str(torch.__version__), "python": sys.version.split()[0],
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    })
    checkpoints.save(out, shipped, extra=extra, dtype=SAVE_DTYPE)
    return shipped, extra
