"""Communication accounting for tensor parallelism: what a step all-reduces, and what a ring costs.

Megatron-style tensor parallelism (Shoeybi et al. 2019; `parallel.tensor_parallel`) all-reduces the
(B, T, D) activations twice per layer (after attention's output projection and after the feed-forward
down projection), so a forward of T new tokens per sequence moves
    bytes = 2 * L * B * T * D * bytes_per_element
through all-reduces, whatever p is (p changes how they travel, not what is summed).

A ring all-reduce of n bytes over p ranks (Patarasuk & Yuan 2009) is a reduce-scatter then an
all-gather: 2(p - 1) steps, each sending n/p bytes to the next rank, so
    seconds = 2(p - 1)/p * n / bandwidth + 2(p - 1) * latency.
At decode (T = 1, small B) n is a few kilobytes: the latency term dominates, which is why decode's
all-reduces are latency-bound and do not shrink with a faster link.
"""

from __future__ import annotations

from .. import _checks


def allreduce_bytes_per_step(num_layers: int, d_model: int, batch_size: int = 1, num_tokens: int = 1,
                             bytes_per_element: float = 2) -> float:
    """Bytes all-reduced by one tensor-parallel forward: 2 all-reduces per layer of (B, T, D) activations.
    num_tokens = 1 gives the bytes per decode step (per generated token of each sequence)."""
    _checks.positive_ints(num_layers=num_layers, d_model=d_model, batch_size=batch_size, num_tokens=num_tokens)
    _checks.finite_positive_float("bytes_per_element", bytes_per_element)
    return 2 * num_layers * batch_size * num_tokens * d_model * bytes_per_element


def ring_allreduce_seconds(nbytes: float, world_size: int, bandwidth: float, latency: float = 0.0) -> float:
    """Seconds of one ring all-reduce of `nbytes` over `world_size` ranks: 2(p-1)/p * n / bandwidth
    (bytes/s, each link) + 2(p-1) * latency (s per step). 0 for one rank (nothing to exchange)."""
    _checks.number("nbytes", nbytes, lo=0)
    _checks.positive_int("world_size", world_size)
    _checks.finite_positive_float("bandwidth", bandwidth)
    _checks.non_negative_float("latency", latency)
    steps = 2 * (world_size - 1)
    return steps / world_size * nbytes / bandwidth + steps * latency


def tensor_parallel_step_seconds(num_layers: int, d_model: int, world_size: int, bandwidth: float,
                                 latency: float = 0.0, batch_size: int = 1, num_tokens: int = 1,
                                 bytes_per_element: float = 2) -> float:
    """Predicted seconds one forward spends in all-reduces: 2L ring all-reduces of B*T*D elements each
    (each pays its own latency, so the latency term is 2L * 2(p-1) * latency)."""
    per_call = allreduce_bytes_per_step(1, d_model, batch_size, num_tokens, bytes_per_element) / 2
    return 2 * num_layers * ring_allreduce_seconds(per_call, world_size, bandwidth, latency)


__all__ = ["allreduce_bytes_per_step", "ring_allreduce_seconds", "tensor_parallel_step_seconds"]
