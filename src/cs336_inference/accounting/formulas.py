"""Accounting: parameters, bytes, FLOPs, KV-cache size, and the latency/throughput they imply.

The lecture's model of decoding (CS336 lecture 10, "throughput and latency"; Pope et al. 2022,
"Efficiently Scaling Transformer Inference", arXiv:2211.05102): each decode step reads every
weight and every sequence's KV cache once, so at small batch it is memory-bound:
    params  = 2VD + 3DFL + (2DNH + 2DKH)L          (embedding + lm_head, SwiGLU, attention)
    memory  = B * KV(S) + bytes(params)
    latency = memory / bandwidth,  throughput = B / latency
Prefill runs the whole prompt in one pass and is compute-bound: TTFT ~ FLOPs / peak FLOP/s.

Every function takes a `ModelConfig` (the model we run), a `ModelShape` (a real model's sizes)
or the name of one in `REAL_MODELS`. Symbolic (sympy) derivations: `accounting_symbolic`.
Conventions for the cache: "bytes per token" is what one cached position of one sequence occupies,
summed over all layers' caches (layers that share a cache count once). Sliding-window layers hold
at most `sliding_window` positions, so the *total* at context S is `kv_cache_bytes`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .. import _checks
from .symbolic import (Cost, attention_cost, attention_intensity_generation,  # noqa: F401
                                  attention_intensity_prefill, generation_flops, matmul_cost,
                                  matmul_intensity_limit, mlp_cost, mlp_intensity_limit, parameter_count,
                                  decode_latency, decode_memory, decode_throughput, kv_cache_bytes_per_sequence)
from ..model.config import ModelConfig
from .hardware import HARDWARE, PRECISION_BYTES, HardwareSpec, get_hardware, precision_bytes  # noqa: F401
from .model_shapes import REAL_MODELS, ModelShape, get_model_shape  # noqa: F401

# --- KV cache ---------------------------------------------------------------------------------


def _is_local(config, layer: int) -> bool:
    """Layer uses the sliding window (hybrids keep every `global_every`-th layer global)."""
    if isinstance(config, ModelConfig):
        return config.layer_window(layer) is not None
    if config.sliding_window is None:
        return False
    return config.global_every is None or (layer + 1) % config.global_every != 0


def _layer_elements_per_token(config) -> int:
    """Cached elements per token per (cache-owning) layer."""
    if config.attention_type == "mla":
        return config.kv_lora_rank + config.rope_head_dim   # latent c + decoupled RoPE key
    return 2 * config.num_kv_heads * config.head_dim       # K and V for each KV head


def _cache_owning_layers(config) -> list[int]:
    """Layers that own a KV cache: with CLA, the first layer of each group of `kv_share_group`; fixed-state
    layers (`ModelConfig.mixer`) keep a state instead (`accounting.fixed_state`)."""
    layers = range(0, config.num_layers, config.kv_share_group)
    if isinstance(config, ModelConfig):
        return [i for i in layers if config.layer_mixer(i) == "attention"]
    return list(layers)


def kv_cache_bytes_per_token(config: ModelConfig | ModelShape, bytes_per_element: int = 2) -> int:
    """Bytes one cached position of one sequence occupies, over all layers (default bf16)."""
    _checks.instance("config", config, (ModelConfig, ModelShape), "a ModelConfig (or a ModelShape)")
    _checks.finite_positive_float("bytes_per_element", bytes_per_element)
    return _layer_elements_per_token(config) * len(_cache_owning_layers(config)) * bytes_per_element


def kv_cache_bytes(config: ModelConfig | ModelShape, batch_size: int, seq_len: int, bytes_per_element: int = 2) -> int:
    """Total cache bytes for `batch_size` sequences of `seq_len` tokens (windows cap local layers)."""
    kv_cache_bytes_per_token(config, bytes_per_element)  # validates
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        _checks.positive_int(name, value)
    per_layer = _layer_elements_per_token(config) * bytes_per_element
    total = 0
    for layer in _cache_owning_layers(config):
        if _is_local(config, layer):
            held = min(seq_len, config.sliding_window + config.attention_sinks)  # window + its sinks
        else:
            held = seq_len
        total += per_layer * held
    return batch_size * total


# --- parameters and FLOPs ---------------------------------------------------------------------


def _attention_weights(s: ModelShape, layer: int) -> int:
    """Matmul weights of one layer's attention (norm weights excluded)."""
    D, N, K, H = s.d_model, s.num_heads, s.num_kv_heads, s.head_dim
    owns_kv = layer % s.kv_share_group == 0   # CLA: only the first layer of a group writes the cache
    if s.attention_type == "mla":  # DeepSeek-V2 layout: low-rank q, joint KV latent, decoupled RoPE
        C, R = s.kv_lora_rank, s.rope_head_dim
        q = D * N * (H + R) if s.q_lora_rank is None else D * s.q_lora_rank + s.q_lora_rank * N * (H + R)
        down = D * (C + R) if owns_kv else 0  # h -> (c, k_rope): what the cache stores
        return q + down + C * N * 2 * H + N * H * D   # c up to per-head K and V; output projection
    return D * N * H + (2 * D * K * H if owns_kv else 0) + N * H * D


def _mlp_weights(s: ModelShape, layer: int, active_only: bool) -> int:
    """Matmul weights of one layer's SwiGLU MLP (w1, w2, w3), or of its experts and router."""
    D = s.d_model
    if s.num_experts == 0 or layer < s.first_dense_layers:
        return 3 * D * s.d_ff
    experts = (s.experts_per_token if active_only else s.num_experts) + s.num_shared_experts
    return experts * 3 * D * s.moe_d_ff + D * s.num_experts  # experts + router


def _norm_weights(s: ModelShape) -> int:
    """RMSNorm gains: two per layer, the final one, and MLA's latent norms."""
    per_layer = 2 * s.d_model
    if s.attention_type == "mla" and s.latent_norms:
        per_layer += s.kv_lora_rank + (s.q_lora_rank or 0)
    return per_layer * s.num_layers + s.d_model


def num_parameters(model, include_norms: bool = False, active_only: bool = False) -> int:
    """Parameter count; for a dense GQA model the lecture's 2VD + 3DFL + (2DNH + 2DKH)L.

    include_norms adds the RMSNorm gains (2DL + D, which the lecture's formula leaves out; the
    `TransformerLM` we run has them). active_only counts the experts one token uses (MoE).
    Tied embeddings (SmolLM2) count the one V x D table once.
    """
    _checks.boolean("include_norms", include_norms)
    _checks.boolean("active_only", active_only)
    s = get_model_shape(model)
    total = (1 if s.tie_embeddings else 2) * s.vocab_size * s.d_model  # token embedding (+ untied lm_head)
    for layer in range(s.num_layers):
        total += _attention_weights(s, layer) + _mlp_weights(s, layer, active_only)
    return total + (_norm_weights(s) if include_norms else 0)


def weight_bytes(model, precision: str = "bf16") -> float:
    """Bytes of all parameters (lecture formula, no norms) stored in `precision`."""
    return num_parameters(model) * precision_bytes(precision)


def forward_flops(model, batch_size: int, num_new_tokens: int, num_cached: int = 0,
                  last_only: bool = False, mla_absorbed: bool = False) -> int:
    """Matmul FLOPs of one forward of `num_new_tokens` per sequence over `num_cached` cached ones.

    Counts 2 FLOPs per multiply-add of every matmul, as `TransformerLM` runs it: the projections and
    MLP (2 * weights per token), q k^T and p v over the S = num_cached + T keys (4 B N T S H per
    layer: the kernel computes the full score matrix and masks it; a sliding-window layer sees at
    most window + T - 1 keys plus its sinks), and the lm_head (for the last position only with
    last_only, as `prefill` does). Elementwise work (norms, RoPE, softmax, SiLU) is left out: it is O(B T D) and
    O(B N T S), small next to the matmuls. MoE: the experts a token activates.
    MLA: keys of H + R dims and values of H (the plain form, as a full forward runs it); with
    mla_absorbed, attention runs over the C + R latent and C-dim values (W_UK and W_UV folded into
    query and output: the same weight FLOPs per token), as `TransformerLM` does with a cache.
    """
    s = get_model_shape(model)
    for name, value in (("batch_size", batch_size), ("num_new_tokens", num_new_tokens)):
        _checks.positive_int(name, value)
    _checks.non_negative_int("num_cached", num_cached)
    B, T, S = batch_size, num_new_tokens, num_cached + num_new_tokens
    qk_dim, v_dim = s.head_dim, s.head_dim
    if s.attention_type == "mla":
        v_dim = s.kv_lora_rank if mla_absorbed else s.head_dim
        qk_dim = v_dim + s.rope_head_dim
    flops = 0
    for layer in range(s.num_layers):
        keys = min(S, s.sliding_window + T - 1 + s.attention_sinks) if _is_local(s, layer) else S
        flops += 2 * B * T * (_attention_weights(s, layer) + _mlp_weights(s, layer, active_only=True))
        flops += 2 * B * s.num_heads * T * keys * (qk_dim + v_dim)   # q k^T and p v
    flops += 2 * B * (1 if last_only else T) * s.d_model * s.vocab_size  # lm_head
    return flops


def _idle_expert_weights(s: ModelShape, batch_size: int) -> int:
    """Expert weights a decode step of B tokens cannot touch: B k routed picks hit at most B k experts."""
    if not s.num_experts:
        return 0
    idle = s.num_experts - min(s.num_experts, batch_size * s.experts_per_token)
    return (s.num_layers - s.first_dense_layers) * idle * 3 * s.d_model * s.moe_d_ff


def decode_step_bytes(model, batch_size: int, seq_len: int, precision: str = "bf16") -> float:
    """Bytes one decode step really reads: weights (not the embedding table) plus the KV cache.

    The lecture's `memory` counts the whole embedding table; a decode step only gathers B rows of
    it. MoE: at most min(E, B * k) routed experts per layer are touched. KV: seq_len positions.
    """
    s = get_model_shape(model)
    _checks.positive_int("batch_size", batch_size)
    _checks.positive_int("seq_len", seq_len)
    nbytes = precision_bytes(precision)
    table = 0 if s.tie_embeddings else s.vocab_size * s.d_model   # tied: the table *is* the lm_head, read in full
    weights = num_parameters(s, include_norms=True) - table - _idle_expert_weights(s, batch_size)
    return nbytes * (weights + batch_size * s.d_model) + kv_cache_bytes(s, batch_size, seq_len, nbytes)


# --- latency and throughput -------------------------------------------------------------------


@dataclass(frozen=True)
class TransformerPerformanceStats:
    """What a model costs on an accelerator at batch B and context S (one decode step, one prefill)."""

    model: str
    hardware: str
    batch_size: int                 # B sequences decoded together
    seq_len: int                    # S tokens per sequence in the cache
    precision: str                  # weights and KV cache stored in this format
    num_parameters: int             # lecture formula (no norm gains)
    weight_bytes: float
    kv_cache_bytes_per_sequence: float
    kv_cache_bytes: float           # B * per sequence
    total_memory_bytes: float       # weights + KV cache
    memory_capacity_bytes: float | None
    fits_in_memory: bool | None     # None when the capacity is unknown (a measured CPU)
    decode_bytes: float             # read per decode step: all of memory (MoE: minus experts no token picks)
    decode_flops: float             # one decode step for the whole batch
    decode_memory_time_s: float     # decode_bytes / bandwidth: read everything once per step
    decode_compute_time_s: float    # decode_flops / peak FLOP/s
    latency_per_token_s: float      # max of the two (memory wins unless B is huge)
    throughput_tokens_per_s: float  # B / latency
    bound: str                      # "memory" or "compute"
    prefill_flops: float            # B prompts of S tokens in one pass
    prefill_time_s: float           # max(FLOPs / peak, bytes / bandwidth): compute-bound for long prompts
    ttft_s: float                   # time to first token = prefill time (its last logits give token 1)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        fits = "" if self.fits_in_memory is None else (" (fits)" if self.fits_in_memory else " (DOES NOT FIT)")
        return (f"{self.model} on {self.hardware}, B={self.batch_size}, S={self.seq_len}, {self.precision}: "
                f"memory {self.total_memory_bytes / 1e9:.1f} GB{fits}, "
                f"latency {self.latency_per_token_s * 1e3:.1f} ms/token "
                f"({self.bound}-bound), throughput {self.throughput_tokens_per_s:,.0f} tokens/s, "
                f"TTFT {self.ttft_s * 1e3:.1f} ms")


def transformer_performance_stats(config, hardware: str | HardwareSpec = "H100", batch_size: int = 1,
                                  seq_len: int = 1024, precision: str = "bf16") -> TransformerPerformanceStats:
    """The lecture's memory / latency / throughput / TTFT for `config` on `hardware`.

    config: a `ModelConfig`, `ModelShape` or a name in `REAL_MODELS`; hardware: a name in `HARDWARE`
    or a `HardwareSpec` (e.g. `measure_hardware(device).to_spec()`); precision: a key of
    `PRECISION_BYTES` (weights and cache alike).
    """
    s = get_model_shape(config)
    hw = get_hardware(hardware)
    _checks.positive_int("batch_size", batch_size)
    _checks.positive_int("seq_len", seq_len)
    if seq_len > s.context_length:
        raise ValueError(f"seq_len {seq_len} exceeds {s.name}'s context_length {s.context_length}")
    nbytes = precision_bytes(precision)
    flops_per_s = hw.flops_for(precision)
    params = num_parameters(s)
    weights = params * nbytes
    kv_seq = kv_cache_bytes(s, 1, seq_len, nbytes)
    kv = batch_size * kv_seq
    memory = weights + kv
    decode_bytes = memory - _idle_expert_weights(s, batch_size) * nbytes
    decode_flops = forward_flops(s, batch_size, 1, seq_len - 1, mla_absorbed=True)
    t_mem, t_compute = decode_bytes / hw.memory_bandwidth, decode_flops / flops_per_s
    latency = max(t_mem, t_compute)
    prefill_flops = forward_flops(s, batch_size, seq_len, 0, last_only=True)
    prefill_time = max(prefill_flops / flops_per_s, memory / hw.memory_bandwidth)
    return TransformerPerformanceStats(
        model=s.name, hardware=hw.name, batch_size=batch_size, seq_len=seq_len, precision=precision,
        num_parameters=params, weight_bytes=weights, kv_cache_bytes_per_sequence=kv_seq, kv_cache_bytes=kv,
        total_memory_bytes=memory, memory_capacity_bytes=hw.memory_bytes,
        fits_in_memory=None if hw.memory_bytes is None else memory <= hw.memory_bytes,
        decode_bytes=decode_bytes, decode_flops=decode_flops, decode_memory_time_s=t_mem,
        decode_compute_time_s=t_compute,
        latency_per_token_s=latency, throughput_tokens_per_s=batch_size / latency,
        bound="memory" if t_mem >= t_compute else "compute",
        prefill_flops=prefill_flops, prefill_time_s=prefill_time, ttft_s=prefill_time)


def with_kv_heads(config, num_kv_heads: int):
    """The same model with K key/value heads (GQA: K = N is MHA, K = 1 is MQA); names it '<name>-K<k>'."""
    s = get_model_shape(config)
    _checks.positive_int("num_kv_heads", num_kv_heads)
    if s.attention_type != "gqa":
        raise ValueError(f"with_kv_heads needs a GQA-family model, {s.name} uses {s.attention_type!r}")
    if s.num_heads % num_kv_heads != 0:
        raise ValueError(f"num_kv_heads must divide num_heads={s.num_heads}, got {num_kv_heads}")
    if isinstance(config, ModelConfig):
        return config.replace(num_kv_heads=num_kv_heads)
    if num_kv_heads == s.num_kv_heads:
        return s
    return s.replace(name=f"{s.name}-K{num_kv_heads}", num_kv_heads=num_kv_heads)


def max_batch_size(config, hardware: str | HardwareSpec = "H100", seq_len: int = 1024,
                   precision: str = "bf16") -> int:
    """Largest B whose weights + B KV caches of seq_len tokens fit in the accelerator's memory (0: none)."""
    s = get_model_shape(config)
    hw = get_hardware(hardware)
    if hw.memory_bytes is None:
        raise ValueError(f"{hw.name} has no known memory capacity")
    _checks.positive_int("seq_len", seq_len)
    nbytes = precision_bytes(precision)
    free = hw.memory_bytes - weight_bytes(s, precision)
    return max(0, int(free // kv_cache_bytes(s, 1, seq_len, nbytes)))


def batch_sweep(model="llama2-13b", hardware="H100", seq_len: int = 1024, batch_sizes=None,
                precision: str = "bf16") -> list:
    """`TransformerPerformanceStats` for each batch size (default 1, 2, 4, ..., 512)."""
    batch_sizes = batch_sizes or [2**i for i in range(10)]
    return [transformer_performance_stats(model, hardware, b, seq_len, precision) for b in batch_sizes]
