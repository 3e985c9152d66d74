"""Where a tensor-parallel decode step's time goes: compute vs all-reduce, one step at a time.

`decode_split_rank` is the function each rank runs (through `launch`): it loads a model, keeps its
shard, probes this group's all-reduce latency and bandwidth, then prefills a given prompt and decodes
greedily, recording for each decode step its seconds and the seconds spent inside the all-reduces
(`CollectiveTimer`). Rank 0's logits come back so the caller can compare them with a one-process
forward. The notebook (09_tensor_parallel) and the lecture use it; `bench tensor_parallel` is the
fuller benchmark.

The all-reduce time a rank records includes waiting for the slowest rank to arrive: on a machine
whose cores are shared, that wait is most of it.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from .. import _checks
from ..model.checkpoints import load_pretrained
from .tensor_parallel import shard_model, sharded_parameter_bytes

PROBE_BYTES = 1 << 20     # the large all-reduce of the bandwidth probe


def probe_allreduce(reps: int = 20, probe_bytes: int = PROBE_BYTES) -> tuple[float, float]:
    """(latency per ring step in s, bandwidth in B/s) of all-reduces among the ranks of the default group,
    from the medians of `reps` tiny (one float) and large (`probe_bytes`) all-reduces, each solved for with
    the ring formula 2(p-1)/p * n / bandwidth + 2(p-1) * latency. Every rank must call it."""
    _checks.positive_ints(reps=reps, probe_bytes=probe_bytes)
    p = dist.get_world_size()
    steps = max(1, 2 * (p - 1))

    def median_seconds(x: torch.Tensor, n: int) -> float:
        times = []
        for _ in range(n):
            dist.barrier()          # start together: the probe should not time the other rank's lateness
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    tiny = median_seconds(torch.zeros(1), reps)
    big = median_seconds(torch.zeros(probe_bytes // 4), max(3, reps // 4))
    latency = tiny / steps
    return latency, steps / p * probe_bytes / max(big - steps * latency, 1e-9)


def decode_split_rank(model_name: str, prompt: list[list[int]], new_tokens: int, probe_reps: int = 20) -> dict:
    """Run on every rank (`launch(decode_split_rank, p, ...)`): shard `model_name` (`load_pretrained`, fp32),
    prefill `prompt` (B rows of equal length), decode `new_tokens` greedy steps, twice (the first round warms
    up). Returns, from the kept round: `prefill_logits` (B, V) and `decode_logits` (steps, B, V), the
    `tokens` chosen, per decode step `step_s` and `comm_s` (seconds inside all-reduces), `all_reduces` per
    step, the probe's `latency_s` and `bandwidth_Bps`, and the bytes this rank holds: `weight_bytes` of
    the sharded projections (and `full_weight_bytes` before sharding) and `cache_bytes` of its KV cache."""
    _checks.positive_ints(new_tokens=new_tokens, probe_reps=probe_reps)
    model = load_pretrained(model_name, dtype=torch.float32).eval()
    full_weight_bytes = sharded_parameter_bytes(model)
    timer = shard_model(model, dist.get_rank(), dist.get_world_size()).tp_timer
    latency, bandwidth = probe_allreduce(probe_reps)
    ids = torch.tensor(prompt, dtype=torch.long)
    B, T = ids.shape
    for _ in range(2):
        cache = model.new_cache(B, T + new_tokens + 1)
        timer.reset()
        step_s, comm_s, decode_logits = [], [], []
        with torch.no_grad():
            with timer.phase("prefill"):
                prefill_logits = model(ids, cache, last_only=True)[:, -1]
            token, tokens = prefill_logits.argmax(-1), []
            with timer.phase("decode"):
                for _ in range(new_tokens):
                    tokens.append(token)
                    before = timer.seconds().get("decode", 0.0)
                    t0 = time.perf_counter()
                    logits = model(token[:, None], cache)[:, -1]
                    step_s.append(time.perf_counter() - t0)
                    comm_s.append(timer.seconds()["decode"] - before)
                    decode_logits.append(logits)
                    token = logits.argmax(-1)
    return dict(prefill_logits=prefill_logits, decode_logits=torch.stack(decode_logits), tokens=torch.stack(tokens, 1),
                step_s=step_s, comm_s=comm_s, all_reduces=timer.calls["decode"] // new_tokens,
                latency_s=latency, bandwidth_Bps=bandwidth, weight_bytes=sharded_parameter_bytes(model),
                full_weight_bytes=full_weight_bytes, cache_bytes=cache.nbytes, threads=torch.get_num_threads())


__all__ = ["decode_split_rank", "probe_allreduce"]
