"""Training the shipped models: AdamW, cosine schedule with warmup, gradient clipping, periodic
validation, deterministic for a seed, resumable from a checkpoint to the same state.

`train_model` trains a given model with any loss (next-token cross-entropy by default; `pruning.distill`
passes a distillation loss); `train_lm` builds a freshly initialised `TransformerLM` and trains it.
AdamW: Loshchilov & Hutter 2019; cosine schedule: Loshchilov & Hutter 2017 (SGDR).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .. import _checks
from ..model.config import ModelConfig
from .corpus import get_batch, load_corpus
from ..device import get_device
from .evaluation import evaluate_lm
from ..model.transformer import TransformerLM


@dataclass
class TrainConfig:
    steps: int = 1000              # optimizer steps
    batch_size: int = 16           # B sequences per step
    seq_len: int = 256             # T tokens per sequence
    lr: float = 3e-3               # peak learning rate (after warmup)
    min_lr_ratio: float = 0.1      # the cosine decays to lr * min_lr_ratio at the last step
    warmup_steps: int = 50
    weight_decay: float = 0.1      # decoupled (AdamW), on matrices only (not norms)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0         # max global gradient norm (0 disables)
    eval_every: int = 100          # validation loss every this many steps (and at the end)
    eval_batches: int = 8          # batches of B x T validation tokens per evaluation
    seed: int = 0                  # model init and batch order
    data_seed: int = 0             # which corpus (data.build_corpus seed)
    device: str | None = None      # None: best available
    num_threads: int | None = None  # torch CPU threads during training (None: leave as is)
    checkpoint_path: str | None = None  # where to save resumable state (None: no checkpoints)
    checkpoint_every: int = 0      # save every this many steps (0: only at the end / when stopping)
    progress: bool = True          # tqdm progress bar

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches"):
            _checks.positive_int(name, getattr(self, name))
        for name in ("warmup_steps", "checkpoint_every", "seed", "data_seed"):
            _checks.non_negative_int(name, getattr(self, name))
        _checks.finite_positive_float("lr", self.lr)
        _checks.probability("min_lr_ratio", self.min_lr_ratio)
        for name in ("beta1", "beta2"):
            _checks.probability(name, getattr(self, name), allow_one=False)
        for name in ("weight_decay", "grad_clip"):
            _checks.non_negative_float(name, getattr(self, name))

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup to `lr`, then a cosine down to `lr * min_lr_ratio` at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    decay_steps = max(1, config.steps - config.warmup_steps - 1)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    low = config.lr * config.min_lr_ratio
    return low + 0.5 * (config.lr - low) * (1 + math.cos(math.pi * progress))


def next_token_loss(model, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the model's next-token logits (B, T, V) against y (B, T)."""
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (linears, embeddings) and none on norm gains."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2))


def _empty_history() -> dict:
    return {"step": [], "train_loss": [], "lr": [], "val_step": [], "val_loss": [], "val_bpb": [],
            "elapsed_s": [], "train_time_s": 0.0, "tokens_seen": 0}


def save_training_state(path, model, optimizer, step: int, generator: torch.Generator, history: dict,
                        train_config: TrainConfig) -> None:
    """Everything needed to continue exactly where we stopped (written atomically)."""
    state = {"model_config": model.config.to_dict(), "model": model.state_dict(),
             "optimizer": optimizer.state_dict(), "step": step, "generator": generator.get_state(),
             "history": history, "train_config": train_config.to_dict()}
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_training_state(path) -> dict:
    """Read a file written by `save_training_state`. Only tensors and plain data are unpickled
    (`weights_only=True`): a resume file from elsewhere cannot run code."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path} is not a training state written by this library (it holds objects other "
                         f"than tensors and plain data, which are never unpickled): {e}") from None
    keys = ("model_config", "model", "optimizer", "step", "generator", "history")
    if not isinstance(state, dict) or any(k not in state for k in keys):
        raise ValueError(f"{path} is not a training state written by this library (expected keys {keys})")
    return state


def train_model(model: TransformerLM, train_config: TrainConfig, train_data: torch.Tensor | None = None,
                val_data: torch.Tensor | None = None, loss_fn: Callable | None = None, resume: bool = False,
                stop_at: int | None = None, desc: str = "train") -> tuple[TransformerLM, dict]:
    """Train `model` in place for `train_config.steps` steps; return (model, history).

    loss_fn(model, x, y) -> scalar loss (default: next-token cross-entropy). resume=True continues
    from `train_config.checkpoint_path` (model, optimizer, step, batch generator, history), which
    gives the same final state as an uninterrupted run. stop_at=n stops after step n and saves (an
    interruption, for tests and long runs).
    """
    _checks.instance("model", model, TransformerLM, "a TransformerLM")
    _checks.instance("train_config", train_config, TrainConfig, "a TrainConfig")
    cfg = train_config
    if cfg.seq_len > model.config.context_length:
        raise ValueError(f"seq_len ({cfg.seq_len}) exceeds the model's context_length ({model.config.context_length})")
    if (resume or stop_at is not None) and cfg.checkpoint_path is None:
        raise ValueError("resume and stop_at need train_config.checkpoint_path")
    train_data = load_corpus("train", cfg.data_seed) if train_data is None else train_data
    val_data = load_corpus("val", cfg.data_seed) if val_data is None else val_data
    loss_fn = loss_fn or next_token_loss
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)

    optimizer = make_optimizer(model, cfg)
    generator = torch.Generator().manual_seed(cfg.seed + 1)
    history, start = _resume(cfg.checkpoint_path, model, optimizer, generator) if resume else (_empty_history(), 0)

    model.train()
    last = cfg.steps if stop_at is None else min(stop_at, cfg.steps)
    bar = tqdm(range(start, last), desc=desc, disable=not cfg.progress, initial=start, total=cfg.steps)
    t_start = time.perf_counter() - history["train_time_s"]
    for step in bar:
        lr = lr_at(step, cfg)
        x, loss = _optimizer_step(model, optimizer, loss_fn, train_data, generator, cfg, lr)
        history["step"].append(step + 1)
        history["train_loss"].append(loss.item())
        history["lr"].append(lr)
        history["tokens_seen"] += x.numel()
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            val = evaluate_lm(model, val_data, cfg.seq_len, cfg.batch_size, cfg.eval_batches)
            history["val_step"].append(step + 1)
            history["val_loss"].append(val["loss"])
            history["val_bpb"].append(val["bits_per_byte"])
            bar.set_postfix(loss=f"{loss.item():.3f}", val_bpb=f"{val['bits_per_byte']:.3f}")
        history["elapsed_s"].append(time.perf_counter() - t_start)
        history["train_time_s"] = time.perf_counter() - t_start
        if cfg.checkpoint_path and ((cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)
                                    or step + 1 == last):
            save_training_state(cfg.checkpoint_path, model, optimizer, step + 1, generator, history, cfg)
    bar.close()
    model.eval()
    return model, history


def _resume(path, model: TransformerLM, optimizer, generator: torch.Generator) -> tuple[dict, int]:
    """Load the model, optimizer and batch generator saved at `path` in place; return (history, step)."""
    state = load_training_state(path)
    if state["model_config"] != model.config.to_dict():
        raise ValueError(f"checkpoint {path} was made for a different model config")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    generator.set_state(state["generator"])
    return state["history"], state["step"]


def _optimizer_step(model, optimizer, loss_fn: Callable, train_data: torch.Tensor, generator: torch.Generator,
                    cfg: TrainConfig, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One step at learning rate `lr` on the next batch (clipped to `cfg.grad_clip`); return (inputs, loss)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    x, y = get_batch(train_data, cfg.batch_size, cfg.seq_len, generator, device=model.device)
    loss = loss_fn(model, x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    optimizer.step()
    return x, loss


def train_lm(model_config: ModelConfig, train_config: TrainConfig, train_data: torch.Tensor | None = None,
             val_data: torch.Tensor | None = None, resume: bool = False, stop_at: int | None = None,
             desc: str = "train") -> tuple[TransformerLM, dict]:
    """A `TransformerLM(model_config)` initialised from `train_config.seed` and trained with next-token loss."""
    _checks.instance("model_config", model_config, ModelConfig, "a ModelConfig")
    _checks.instance("train_config", train_config, TrainConfig, "a TrainConfig")
    device = get_device(train_config.device)
    torch.manual_seed(train_config.seed)
    model = TransformerLM(model_config, device=device)
    return train_model(model, train_config, train_data, val_data, resume=resume, stop_at=stop_at, desc=desc)
