"""The reference solution, accounting: FLOPs, bytes, latency and throughput, numeric and symbolic (sympy).

See the package docstring; each function is a thin wrapper over the library."""

from __future__ import annotations

from ...accounting import formulas as _formulas
from ...accounting import symbolic as _symbolic
from ...accounting.hardware import HardwareSpec
from ...accounting.model_shapes import ModelShape
from ..registry import graded


PRECISIONS = {4: "fp32", 2: "bf16", 1: "int8", 0.5: "int4"}


def _shape(model: dict, context_length: int) -> ModelShape:
    return ModelShape(name="homework", context_length=context_length, **{k: model[k] for k in (
        "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "d_ff")})


@graded("accounting")
def kv_cache_bytes(batch_size: int, seq_len: int, num_layers: int, num_kv_heads: int, head_dim: int,
                   bytes_per_element: float = 2) -> int:
    """Bytes of the KV cache of B = batch_size sequences of S = seq_len tokens: every layer stores a key
    and a value vector of H dims for each of its K heads at every position."""
    model = dict(vocab_size=1, d_model=num_kv_heads * head_dim, num_layers=num_layers, num_heads=num_kv_heads,
                 num_kv_heads=num_kv_heads, head_dim=head_dim, d_ff=1)
    return int(_formulas.kv_cache_bytes(_shape(model, seq_len), batch_size, seq_len, bytes_per_element))


@graded("accounting")
def window_kv_cache_bytes(batch_size: int, seq_len: int, num_layers: int, num_kv_heads: int, head_dim: int,
                          window: int, global_every: int | None = None, bytes_per_element: float = 2) -> int:
    """Bytes of the KV cache of B = batch_size sequences of S = seq_len tokens when layers attend over a
    sliding window (Mistral 7B): a local layer keeps only the last `window` positions (min(S, window)),
    a global one all S. global_every None: every layer is local; else layer l (0-based) is global when
    (l + 1) % global_every == 0 (one in every global_every, the last of each group: Gemma-style hybrids).
    Each kept position holds a key and a value vector of H dims for each of the K heads."""
    model = dict(vocab_size=1, d_model=num_kv_heads * head_dim, num_layers=num_layers, num_heads=num_kv_heads,
                 num_kv_heads=num_kv_heads, head_dim=head_dim, d_ff=1)
    shape = _shape(model, seq_len).replace(sliding_window=window, global_every=global_every)
    return int(_formulas.kv_cache_bytes(shape, batch_size, seq_len, bytes_per_element))


@graded("accounting")
def latent_kv_cache_bytes(batch_size: int, seq_len: int, num_layers: int, kv_lora_rank: int, rope_head_dim: int,
                          bytes_per_element: float = 2) -> int:
    """Bytes of multi-head latent attention's cache (DeepSeek-V2): per position and layer, one latent of
    C = kv_lora_rank numbers plus the decoupled RoPE key of R = rope_head_dim numbers, shared by every
    head (no separate values), for B = batch_size sequences of S = seq_len tokens."""
    shape = ModelShape(name="homework", vocab_size=1, d_model=2, num_layers=num_layers, num_heads=1, num_kv_heads=1,
                       head_dim=2, d_ff=1, context_length=seq_len, attention_type="mla", kv_lora_rank=kv_lora_rank,
                       rope_head_dim=rope_head_dim)
    return int(_formulas.kv_cache_bytes(shape, batch_size, seq_len, bytes_per_element))


@graded("accounting")
def inference_stats(model: dict, hardware: dict, batch_size: int, seq_len: int,
                    bytes_per_element: float = 2) -> dict[str, float]:
    """The lecture's model of serving a dense Llama-style Transformer (weights and cache in one precision).

    model: vocab_size V, d_model D, d_ff F, num_layers L, num_heads N, num_kv_heads K, head_dim H.
    hardware: peak_flops (FLOP/s), memory_bandwidth (B/s). B = batch_size sequences, S = seq_len.
    Returns a dict:
      num_parameters   P = 2VD + 3DFL + (2DNH + 2DKH)L (embedding and untied lm_head, SwiGLU, attention);
      weight_bytes     P * bytes_per_element;
      kv_cache_bytes   B sequences of S positions (as `kv_cache_bytes`);
      total_memory_bytes  weights + cache;
      decode_flops     one decode step of the B sequences at the S-th position: 2 FLOPs per multiply-add,
                       2 B (P - V D) for the matmuls (every weight but the embedding table) plus attention
                       4 B N S H per layer (q k^T and p v over S keys);
      latency_per_token_s  the decode step's time: the larger of its memory time (all memory read once,
                       total_memory_bytes / bandwidth) and its compute time (decode_flops / peak);
      throughput_tokens_per_s  tokens per second over the batch;
      prefill_flops    the B prompts of S tokens in one pass: 2 B S (P - 2 V D) + 4 B N S^2 H L, plus the
                       lm_head for the last position only (2 B D V);
      prefill_time_s   the larger of prefill_flops / peak and total_memory_bytes / bandwidth.
    """
    shape = _shape(model, seq_len)
    spec = HardwareSpec("homework", peak_flops=hardware["peak_flops"], memory_bandwidth=hardware["memory_bandwidth"],
                        memory_bytes=None, source="homework")
    stats = _formulas.transformer_performance_stats(shape, spec, batch_size, seq_len, PRECISIONS[bytes_per_element])
    keys = ("num_parameters", "weight_bytes", "kv_cache_bytes", "total_memory_bytes", "decode_flops",
            "latency_per_token_s", "throughput_tokens_per_s", "prefill_flops", "prefill_time_s")
    return {key: getattr(stats, key) for key in keys}


@graded("accounting")
def matmul_cost() -> tuple:
    """sympy (flops, bytes) of Y (B x F) = X (B x D) @ W (D x F) in bf16 (2 bytes per element): read X
    and W, write Y; a multiply-add is 2 FLOPs. Symbols are named by the lecture's letters (any
    assumptions: the grader substitutes numbers by name)."""
    cost = _symbolic.matmul_cost()
    return cost.flops, cost.bytes


@graded("accounting")
def mlp_cost() -> tuple:
    """sympy (flops, bytes) of a SwiGLU MLP on X (B x T x D), bf16: up and gate projections (D -> F), down
    projection (F -> D). Bytes as the lecture counts them: X read once, the up and gate outputs written,
    the activation fused into the down projection's read, each weight read once, the output written."""
    cost = _symbolic.mlp_cost()
    return cost.flops, cost.bytes


@graded("accounting")
def attention_cost() -> tuple:
    """sympy (flops, bytes) of attention of T new queries over S keys per sequence (B sequences, D = N H
    summed over heads, bf16, a fused kernel: the scores never reach memory): q k^T and p v, reading Q,
    K, V and writing the output."""
    cost = _symbolic.attention_cost()
    return cost.flops, cost.bytes


@graded("accounting")
def generation_flops() -> dict:
    """sympy total FLOPs to generate T tokens from an empty context, in T, P (non-embedding parameters),
    L, D: a forward over t tokens costs 2 P t plus attention 4 L D t^2 over t x t positions.
    Returns {"naive": re-running the whole prefix at every step, "cached": one token per step over the
    t cached positions (KV cache)}."""
    return dict(_symbolic.generation_flops())


@graded("accounting")
def decode_cost() -> dict:
    """sympy costs of one memory-bound decode step (bf16), in B, S, K, H, L, V, D, F, N and `bandwidth`:
    {"kv_cache_bytes_per_sequence": S positions of keys and values, K heads of H dims, L layers;
     "memory": bytes read per step, B caches plus the weights (P = 2VD + 3DFL + (2DNH + 2DKH)L);
     "latency": memory / bandwidth (seconds per step);
     "throughput": tokens per second for the batch}."""
    return {"kv_cache_bytes_per_sequence": _symbolic.kv_cache_bytes_per_sequence(),
            "memory": _symbolic.decode_memory(), "latency": _symbolic.decode_latency(),
            "throughput": _symbolic.decode_throughput()}
