"""Multi-query associative recall (MQAR): can a model look up what it was told earlier?

Zoology (Arora et al. 2023) traced most of the quality gap between attention and fixed-state models
(linear attention, state-space models) to this one skill. A sequence first lists `num_pairs`
key-value pairs, then asks for every key again, in a random order, at random later positions
(filler token 0 elsewhere); at each query the model must output that key's value. Attention can
look the pair up however many there are; a fixed-state layer must have squeezed all pairs into its
state, so recall falls once the pairs outgrow it (BASED, Arora et al. 2024).

Vocabulary: 0 is the filler, keys are 1 .. num_keys, values the next num_values ids.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .. import _checks

IGNORE = -100   # target of every position that is not a query (cross_entropy's ignore_index)


@dataclass(frozen=True)
class MQARTask:
    num_keys: int = 64         # distinct keys (ids 1 .. num_keys)
    num_values: int = 64       # distinct values (ids num_keys + 1 .. num_keys + num_values)
    seq_len: int = 128         # tokens per sequence: 2 per pair, then the queries among filler

    def __post_init__(self) -> None:
        for name in ("num_keys", "num_values", "seq_len"):
            _checks.positive_int(name, getattr(self, name))

    @property
    def vocab_size(self) -> int:
        return 1 + self.num_keys + self.num_values

    def max_pairs(self) -> int:
        """The most pairs a sequence holds: each pair takes 2 tokens and is queried once."""
        return min(self.num_keys, self.seq_len // 3)

    def batch(self, batch_size: int, num_pairs: int, generator: torch.Generator | None = None,
              device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), both (B, seq_len): targets hold a value at each query and IGNORE elsewhere."""
        _checks.positive_int("batch_size", batch_size)
        _checks.integer("num_pairs", num_pairs, 1, self.max_pairs(),
                        allowed=f"an int in [1, {self.max_pairs()}] (distinct keys, 3 tokens per pair in seq_len)")
        B, D, T = batch_size, num_pairs, self.seq_len
        keys = torch.rand(B, self.num_keys, generator=generator).argsort(-1)[:, :D] + 1           # (B, D) distinct
        values = torch.randint(0, self.num_values, (B, D), generator=generator) + 1 + self.num_keys
        inputs = torch.zeros(B, T, dtype=torch.long)
        targets = torch.full((B, T), IGNORE, dtype=torch.long)
        inputs[:, 0:2 * D:2], inputs[:, 1:2 * D:2] = keys, values
        # each key queried once, in a random order, at D random positions after the pairs (sorted)
        slots = torch.rand(B, T - 2 * D, generator=generator).argsort(-1)[:, :D].sort(-1).values + 2 * D
        order = torch.rand(B, D, generator=generator).argsort(-1)
        rows = torch.arange(B)[:, None]
        inputs[rows, slots] = keys.gather(1, order)
        targets[rows, slots] = values.gather(1, order)
        return inputs.to(device), targets.to(device)


def mqar_loss(model, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy at the query positions only."""
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE)


@torch.no_grad()
def mqar_recall(model, task: MQARTask, num_pairs: int, num_sequences: int = 256, batch_size: int = 64,
                seed: int = 1234) -> float:
    """Fraction of queries whose argmax prediction is the right value (one full forward per batch)."""
    generator = torch.Generator().manual_seed(seed)
    was_training, correct, total = model.training, 0, 0
    model.eval()
    for start in range(0, num_sequences, batch_size):
        inputs, targets = task.batch(min(batch_size, num_sequences - start), num_pairs, generator, model.device)
        predicted = model(inputs).argmax(-1)
        queried = targets != IGNORE
        correct += int((predicted[queried] == targets[queried]).sum())
        total += int(queried.sum())
    model.train(was_training)
    return correct / total


@dataclass(frozen=True)
class MQARTraining:
    steps: int = 1500
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    pairs: tuple[int, ...] = (4, 8, 16, 32)   # each batch draws one of these (Zoology trains on a mix)
    seed: int = 0


def train_mqar(model, task: MQARTask, training: MQARTraining = MQARTraining()) -> dict:
    """Train `model` in place on MQAR batches (AdamW, warmup then cosine); return its loss history."""
    from .training import TrainConfig, lr_at, make_optimizer

    schedule = TrainConfig(steps=training.steps, lr=training.lr, warmup_steps=training.warmup_steps,
                           weight_decay=training.weight_decay, seq_len=task.seq_len, progress=False)
    optimizer = make_optimizer(model, schedule)
    generator = torch.Generator().manual_seed(training.seed)
    losses, t0 = [], time.perf_counter()
    model.train()
    for step in range(training.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, schedule)
        pairs = training.pairs[int(torch.randint(len(training.pairs), (1,), generator=generator))]
        inputs, targets = task.batch(training.batch_size, pairs, generator, model.device)
        loss = mqar_loss(model, inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            raise FloatingPointError(f"MQAR training diverged at step {step} (loss {losses[-1]})")
    model.eval()
    return {"loss": losses, "seconds": time.perf_counter() - t0}
