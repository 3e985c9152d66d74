"""`generate` over tensor-parallel ranks: every rank loads the model, keeps its shard, and runs the
same generation; rank 0's tokens come back (with the seconds spent in all-reduces, per phase).

Every rank computes the same logits (the all-reduces leave identical sums on every rank) and samples
with the same seeded generator, so every rank picks the same tokens without sending them.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..generation.generate import generate
from ..model.checkpoints import load_pretrained
from ..model.gguf import gguf_config, read_gguf
from ..model.real_models import REAL_MODELS, gguf_path
from .launch import launch
from .tensor_parallel import check_tensor_parallel, shard_model


def named_config(name: str):
    """The config of a model `load_pretrained` knows, without its weights (a real model's from its GGUF header)."""
    if name in REAL_MODELS:
        return gguf_config(read_gguf(gguf_path(name)))
    return load_pretrained(name).config   # a shipped toy: small


def _generate_rank(name: str, prompt_ids: list[int], max_new_tokens: int, dtype, sampling: dict, seed: int) -> dict:
    model = load_pretrained(name, dtype=dtype).eval()
    timer = shard_model(model, dist.get_rank(), dist.get_world_size()).tp_timer
    generator = torch.Generator().manual_seed(seed)
    t0 = time.perf_counter()
    with torch.no_grad(), timer.phase("generate"):
        result = generate(model, prompt_ids, max_new_tokens, generator=generator, **sampling)
    return dict(tokens=result.tokens[0], seconds=time.perf_counter() - t0, communication_s=timer.seconds(),
                all_reduces=sum(timer.calls.values()))


def generate_tensor_parallel(name: str, prompt_ids: list[int], max_new_tokens: int, world_size: int,
                             dtype: torch.dtype | None = None, seed: int = 0, temperature: float = 0.0,
                             top_k: int | None = None, top_p: float | None = None, stop_tokens=None,
                             timeout_s: float | None = None) -> dict:
    """Generate from the model `name` (`load_pretrained`) sharded over `world_size` local ranks (gloo).
    Returns {"tokens", "seconds", "communication_s": {phase: s}, "all_reduces"} from rank 0."""
    check_tensor_parallel(named_config(name), world_size)   # refused here, before any process starts
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, stop_tokens=stop_tokens)
    return launch(_generate_rank, world_size, name, list(prompt_ids), max_new_tokens, dtype, sampling, seed,
                  timeout_s=timeout_s)


__all__ = ["generate_tensor_parallel"]
