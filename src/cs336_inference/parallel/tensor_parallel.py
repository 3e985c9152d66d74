"""Megatron-style tensor parallelism for `TransformerLM` over `torch.distributed`.

Shoeybi et al. 2019 (Megatron-LM). Each of p ranks holds 1/p of every attention and feed-forward
layer and runs the same forward on the same tokens:

- column-parallel (no communication): q/k/v keep whole heads, rank r the heads [r N/p, (r+1) N/p) of
  q and [r K/p, (r+1) K/p) of k/v, so each rank's query heads attend over its own key/value heads (GQA
  groups stay whole); SwiGLU's w1/w3 keep d_ff/p rows each;
- row-parallel: output_proj and w2 take the matching d_model x (N H / p) and d_model x (d_ff / p)
  columns; each rank's output is a partial sum, and ONE all-reduce per projection adds them up.

So a block costs two all-reduces of its (B, T, D) activations, and each rank's KV cache holds K/p heads
(`new_cache` asks each sharded layer for its head count). The embedding, norms and lm_head stay whole
on every rank, so every rank computes the same logits. The same code runs gloo on a CPU and NCCL on
CUDA; `init_distributed` uses the `env://` rendezvous, so `torchrun` starts it as well as `launch`.
`CollectiveTimer` records the seconds spent inside the all-reduces, per phase (prefill, decode):
that time includes waiting for the slowest rank, which is what a step loses to communication.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from ..model.gqa import GroupedQueryAttention
from ..model.layers import SwiGLU
from ..model.transformer import TransformerLM
from ..model.variants import SiLUFeedForward


class CollectiveTimer:
    """Seconds spent inside collectives, per phase ("prefill", "decode", or whatever `phase` names).

    On a CPU the all-reduce returns when it is done, so a clock around it is exact. On CUDA the call
    only enqueues work: the timer records two events per call (no host sync in the forward) and reads
    them when `seconds()` is asked, after the step.
    """

    def __init__(self):
        self.current = "other"
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def phase(self, name: str):
        """Attribute the collectives run inside this context to `name`."""
        previous, self.current = self.current, name
        try:
            yield self
        finally:
            self.current = previous

    def all_reduce(self, x: torch.Tensor, group=None) -> torch.Tensor:
        """Sum x over the ranks of `group` in place (timed); returns x."""
        name = self.current
        self.calls[name] = self.calls.get(name, 0) + 1
        if x.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_reduce(x, group=group)
            end.record()
            self._events.append((name, start, end))
        else:
            t0 = time.perf_counter()
            dist.all_reduce(x, group=group)
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0
        return x

    def seconds(self) -> dict[str, float]:
        """Seconds per phase so far (reads any pending CUDA events: a sync, so call it between steps)."""
        if self._events:
            torch.cuda.synchronize()
            for name, start, end in self._events:
                self.totals[name] = self.totals.get(name, 0.0) + start.elapsed_time(end) / 1e3
            self._events.clear()
        return dict(self.totals)

    def reset(self) -> None:
        self.seconds()
        self.totals.clear()
        self.calls.clear()


class RowParallelLinear(nn.Linear):
    """A linear holding some input columns of a projection: y = all_reduce(x_shard W_shard^T).

    A subclass of nn.Linear, so the state dict keeps the CS336 key (`output_proj.weight`, `w2.weight`).
    """

    def __init__(self, weight: torch.Tensor, timer: CollectiveTimer, group=None):
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.timer, self.group = timer, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., I/p) -> (..., O), summed over the ranks
        return self.timer.all_reduce(super().forward(x), self.group)


def check_tensor_parallel(config, world_size: int) -> None:
    """Refuse a world size that does not divide the heads, key/value heads and d_ff (naming the sizes)."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    sizes = {"num_heads": config.num_heads, "num_kv_heads": config.num_kv_heads, "d_ff": config.d_ff}
    bad = {name: n for name, n in sizes.items() if n % world_size}
    if bad:
        divisors = [p for p in range(1, config.num_kv_heads + 1)
                    if all(n % p == 0 for n in sizes.values())]
        raise ValueError(f"tensor parallel size {world_size} must divide num_heads={config.num_heads}, "
                         f"num_kv_heads={config.num_kv_heads} and d_ff={config.d_ff} (whole heads per rank); "
                         f"not divisible by {world_size}: " + ", ".join(f"{k}={v}" for k, v in bad.items())
                         + f" (sizes that work: {divisors})")
    if config.attention_type != "gqa" or any(config.layer_mixer(i) != "attention" for i in range(config.num_layers)):
        raise ValueError(f"tensor parallelism shards grouped-query attention (MHA/GQA/MQA, windows, CLA); "
                         f"this config has attention_type={config.attention_type!r} and mixers "
                         f"{sorted({config.layer_mixer(i) for i in range(config.num_layers)})}")


def _rows(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    n = weight.shape[0] // world_size
    return weight.detach()[rank * n:(rank + 1) * n].clone()          # a copy: the full matrix can be freed


def _columns(weight: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    n = weight.shape[1] // world_size
    return weight.detach()[:, rank * n:(rank + 1) * n].contiguous().clone()


def _column_parallel(linear: nn.Linear, rank: int, world_size: int) -> nn.Linear:
    w = _rows(linear.weight, rank, world_size)
    shard = nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    shard.weight = nn.Parameter(w, requires_grad=False)
    return shard


def _check_plain(name: str, module: nn.Module) -> None:
    if type(module) is not nn.Linear or module.bias is not None:
        raise TypeError(f"{name} is a {type(module).__name__}; tensor parallelism shards plain bias-free "
                        f"nn.Linear layers (shard before quantizing)")


@torch.no_grad()
def shard_model(model: TransformerLM, rank: int, world_size: int, timer: CollectiveTimer | None = None,
                group=None) -> TransformerLM:
    """Keep rank `rank`'s 1/world_size of every attention and feed-forward layer of `model`, in place.

    Every rank must start from the same weights (load them, then shard). Fused projections are unfused
    first (fuse again after sharding if wanted). Returns the model; `model.tp_timer` is its timer.
    """
    check_tensor_parallel(model.config, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    timer = timer or CollectiveTimer()
    for i, block in enumerate(model.layers):   # every layer checked before any changes
        attn, ffn = block.attn, block.ffn
        if not isinstance(attn, GroupedQueryAttention) or not isinstance(ffn, (SwiGLU, SiLUFeedForward)):
            raise TypeError(f"layer {i}: cannot shard {type(attn).__name__} / {type(ffn).__name__}")
        for part in (attn, ffn):
            fused = getattr(part, "qkv_proj", None) or getattr(part, "w13", None)
            if fused is not None:
                _check_plain(f"layers.{i} fused projection", fused.proj)
        for name in ("q_proj", "k_proj", "v_proj", "output_proj"):
            if hasattr(attn, name):
                _check_plain(f"layers.{i}.attn.{name}", getattr(attn, name))
        for name in ("w1", "w2", "w3"):
            if hasattr(ffn, name):
                _check_plain(f"layers.{i}.ffn.{name}", getattr(ffn, name))
    model.unfuse_projections()
    for block in model.layers:
        attn, ffn = block.attn, block.ffn
        names = ["q_proj", "output_proj"] + (["k_proj", "v_proj"] if attn.owns_kv else [])
        for name in names:
            if name != "output_proj":   # whole heads: N/p (or K/p) heads of H rows each
                setattr(attn, name, _column_parallel(getattr(attn, name), rank, world_size))
        attn.output_proj = RowParallelLinear(_columns(attn.output_proj.weight, rank, world_size), timer, group)
        attn.num_heads //= world_size
        attn.num_kv_heads //= world_size
        for name in ("w1", "w3"):
            if hasattr(ffn, name):
                setattr(ffn, name, _column_parallel(getattr(ffn, name), rank, world_size))
        ffn.w2 = RowParallelLinear(_columns(ffn.w2.weight, rank, world_size), timer, group)
    model.tp_timer, model.tp_rank, model.tp_world_size = timer, rank, world_size
    return model


def sharded_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters that tensor parallelism shards (attention and feed-forward projections)."""
    return sum(p.nbytes for name, p in model.named_parameters()
               if (".attn." in name and name.endswith("_proj.weight")) or ".ffn.w" in name)


def init_distributed(backend: str | None = None, device: str | torch.device = "cpu") -> tuple[int, int]:
    """Join the process group from the environment (`env://`: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
    as torchrun and `launch` set them); return (rank, world_size). backend: "gloo" on a CPU, "nccl" on CUDA."""
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.device(device).type == "cuda" else "gloo")
        dist.init_process_group(backend, init_method="env://")
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())) % torch.cuda.device_count())
    return dist.get_rank(), dist.get_world_size()


def tensor_parallel(model: TransformerLM, timer: CollectiveTimer | None = None) -> TransformerLM:
    """Shard `model` for this process's rank of the initialised default group (`init_distributed`)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call init_distributed() (or run under "
                           "torchrun / parallel.launch) before tensor_parallel(model)")
    return shard_model(model, dist.get_rank(), dist.get_world_size(), timer)


__all__ = ["CollectiveTimer", "RowParallelLinear", "check_tensor_parallel", "init_distributed", "shard_model",
           "sharded_parameter_bytes", "tensor_parallel"]
