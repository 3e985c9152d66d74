"""The lecture's accounting, symbolically (sympy), step by step as CS336 lecture 10 derives it.

Every function returns sympy expressions in the lecture's letters, so the lecture can `# @inspect`
them and the tests can compare them with the lecture's results. bf16 throughout: 2 bytes per
element. Roofline background: Williams, Waterman & Patterson 2009; the inference version of the
argument: Pope et al. 2022 (arXiv:2211.05102).
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

# The lecture's letters; positive so that sympy can decide signs and take limits.
B, S, T, D, F, N, K, H, L, V, P = sp.symbols("B S T D F N K H L V P", positive=True)
bandwidth = sp.Symbol("bandwidth", positive=True)
BYTES = 2  # bf16


@dataclass(frozen=True)
class Cost:
    """FLOPs and bytes moved by one operation; `intensity` = FLOPs per byte."""

    flops: sp.Expr
    bytes: sp.Expr

    @property
    def intensity(self) -> sp.Expr:
        return sp.simplify(self.flops / self.bytes)


def matmul_cost() -> Cost:
    """Y (B x F) = X (B x D) @ W (D x F): read X and W, write Y; one multiply-add = 2 FLOPs."""
    flops = 2 * B * D * F
    nbytes = BYTES * B * D + BYTES * D * F + BYTES * B * F
    return Cost(flops, nbytes)


def matmul_intensity_limit() -> sp.Expr:
    """Intensity when B << D, F (D, F -> infinity): B. Batch 1 (matrix-vector) has intensity 1."""
    return sp.limit(sp.limit(matmul_cost().intensity, D, sp.oo), F, sp.oo)


def mlp_cost() -> Cost:
    """SwiGLU MLP on X (B x T x D): up and gate projections (D -> F), down projection (F -> D).

    Bytes as the lecture counts them: X is read once (the gate reuses it), the up and gate outputs
    are written, the activation (SiLU(gate) * up) is fused into the down projection's read.
    """
    flops = bytes_ = 0
    flops += 2 * B * T * D * F; bytes_ += BYTES * B * T * D + BYTES * D * F + BYTES * B * T * F  # up
    flops += 2 * B * T * D * F; bytes_ += BYTES * D * F + BYTES * B * T * F                      # gate
    flops += 2 * B * T * F * D; bytes_ += BYTES * F * D + BYTES * B * T * D                      # down
    return Cost(sp.expand(flops), sp.expand(bytes_))


def mlp_intensity_limit() -> sp.Expr:
    """Intensity when B T << D, F: B T (the tokens processed together)."""
    return sp.limit(sp.limit(mlp_cost().intensity, D, sp.oo), F, sp.oo)


def attention_cost() -> Cost:
    """Attention of T new queries over S keys per sequence (fused kernel: scores never hit memory).

    q k^T: (B, T, D) x (B, S, D) -> (B, T, S); p v: (B, T, S) x (B, S, D) -> (B, T, D), summed over
    heads (D = N H). Bytes: read Q (B T D), K and V (B S D each), write the output (B T D).
    """
    flops = 2 * B * S * T * D + 2 * B * S * T * D
    nbytes = BYTES * B * T * D + BYTES * B * S * D + BYTES * B * S * D + BYTES * B * T * D
    return Cost(sp.expand(flops), sp.expand(nbytes))


def attention_intensity_prefill() -> sp.Expr:
    """T = S (the whole prompt at once): S / 2, large for long prompts."""
    return sp.simplify(attention_cost().intensity.subs(T, S))


def attention_intensity_generation() -> sp.Expr:
    """T = 1 (one new token): S / (S + 1) < 1 for every S, and no B: each sequence reads its own cache."""
    return sp.simplify(attention_cost().intensity.subs(T, 1))


def generation_flops() -> dict[str, sp.Expr]:
    """Total FLOPs to generate T tokens from nothing, without and with a KV cache.

    A forward over t tokens costs 2 P t (matmuls against the P non-embedding weights) plus
    attention over t x t positions, 4 t^2 D per layer. Naive generation re-runs the prefix:
    step t processes t tokens. With a KV cache step t processes 1 token against t cached keys.
    """
    t = sp.Symbol("t", positive=True, integer=True)
    naive = sp.summation(2 * P * t + 4 * L * D * t * t, (t, 1, T))     # O(T^3)
    cached = sp.summation(2 * P + 4 * L * D * t, (t, 1, T))            # O(T^2)
    return {"naive": sp.factor(naive), "cached": sp.factor(cached)}


def parameter_count() -> sp.Expr:
    """params = 2VD + 3DFL + (2DNH + 2DKH)L: embedding and lm_head, SwiGLU, q/o and k/v projections."""
    return 2 * V * D + 3 * D * F * L + (2 * D * N * H + 2 * D * K * H) * L


def kv_cache_bytes_per_sequence() -> sp.Expr:
    """S tokens x K heads x H dims x L layers x 2 (key and value) x 2 bytes."""
    return S * K * H * L * 2 * BYTES


def decode_memory() -> sp.Expr:
    """Bytes a decode step must read: B caches plus the weights (bf16)."""
    return B * kv_cache_bytes_per_sequence() + BYTES * parameter_count()


def decode_latency() -> sp.Expr:
    """Seconds per decode step when memory-bound: memory / bandwidth."""
    return decode_memory() / bandwidth


def decode_throughput() -> sp.Expr:
    """Tokens per second: B tokens per step."""
    return B / decode_latency()
