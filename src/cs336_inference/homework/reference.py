"""The reference solution of the homework: every graded function with the signature and docstring a
student implements, each a thin wrapper over the library (where the algorithm lives once).

Plain tensors, numbers and weight dicts in, tensors (or sympy expressions, or numbers) out, as in the
CS336 assignments: nothing here asks a student to reproduce a library object. Letters in shapes: B batch,
S positions already cached (or the key length), T new tokens, D d_model, F d_ff, N query heads, K key/value
heads, H head dim, R rotated (RoPE) dims, C latent dims (MLA), L layers, V vocabulary, I/O input/output
features, g group size. The grader (`pytest tests/graded --impl PACKAGE`) calls these names in PACKAGE;
`python -m cs336_inference homework init DIR` writes the skeleton from this file.
"""

from __future__ import annotations

import sys

import torch
from einops import rearrange

from ..accounting import formulas as _formulas
from ..accounting import symbolic as _symbolic
from ..accounting.hardware import HardwareSpec
from ..accounting.model_shapes import ModelShape
from ..data import corpus as _corpus
from ..generation import sampling as _sampling
from ..model import attention as _attention
from ..model import layers as _layers
from ..model import mla as _mla
from ..model import rolling_kv_cache as _rolling
from ..model.kv_cache import CacheStep
from ..quantization import core as _core
from ..quantization import gptq as _gptq
from ..quantization import kv as _kv
from ..quantization import llm_int8 as _llm_int8
from ..quantization import packing as _packing
from .. import serving as _serving
from .registry import graded

# --- sampling -----------------------------------------------------------------------------------


@graded("sampling")
def logits_to_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                    top_p: float | None = None) -> torch.Tensor:
    """The distribution the next token is drawn from.

    logits: (..., V) float. Returns probs (..., V) float32, summing to 1 over V.
    In this order: temperature 0 means greedy (a one-hot on the argmax, nothing else applies); otherwise
    divide the logits by `temperature`; top_k keeps the k largest logits (every logit equal to the k-th
    largest stays); softmax; top_p keeps the smallest set of most likely tokens whose probability reaches
    top_p: a token is dropped exactly when the tokens ranked before it (sorted by probability, descending)
    already sum to >= top_p; renormalise what is kept. None disables a filter.
    """
    return _sampling.logits_to_probs(logits, temperature, top_k, top_p)


@graded("sampling")
def sample_next_token(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                      top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Draw the next token of each row.

    logits: (B, V) or (V,) float. Returns token ids (B,) or () int64, each drawn independently from
    `logits_to_probs(logits, temperature, top_k, top_p)` using `generator` (torch.multinomial takes one);
    temperature 0 returns the argmax.
    """
    return _sampling.sample_next_token(logits, temperature, top_k, top_p, generator)


# --- attention: GQA, a KV cache, MLA, sliding windows ------------------------------------------


@graded("attention")
def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            mask: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query attention: N query heads share K key/value heads (G = N / K consecutive query heads
    per key/value head: query head n reads key/value head n // G). MHA is K = N, MQA is K = 1.

    q: (B, N, T, H); k: (B, K, S, H); v: (B, K, S, H); mask: bool, True = may attend, (T, S) or
    (B, 1, T, S) (the same for every head), or None (everything visible). Returns (B, N, T, H):
    softmax(q k^T / sqrt(H), masked) v per head.
    """
    if mask is not None and mask.dim() == 2:
        mask = mask[None, None]                              # (1, 1, T, S)
    return _attention.grouped_attention(q, k, v, mask)


@graded("attention")
def attention_with_kv_cache(x: torch.Tensor, weights: dict[str, torch.Tensor], k_cache: torch.Tensor,
                            v_cache: torch.Tensor, num_heads: int,
                            rope_theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One causal self-attention layer run on T new tokens that follow S cached ones (prefill: S = 0;
    decode: T = 1), with RoPE and grouped-query attention.

    x: (B, T, D), the new tokens' inputs, at positions S .. S + T - 1.
    weights: "q_proj" (N H, D), "k_proj" (K H, D), "v_proj" (K H, D), "output_proj" (D, N H) (the CS336
    assignment-1 layout: y = x W^T); K = k_proj rows / H with H = q_proj rows / num_heads.
    k_cache, v_cache: (B, K, S, H), the keys (already rotated) and values of the S earlier positions.
    RoPE: rotate adjacent pairs (x[2i], x[2i+1]) of q and k by angle p * rope_theta^(-2i/H) at position p.
    Query t attends to every cached position and to new positions <= its own.
    Returns (out (B, T, D), k_cache' (B, K, S + T, H), v_cache' (B, K, S + T, H)): the output projection
    of the attention, and the caches with the new (rotated) keys and values appended.
    """
    B, T, D = x.shape
    S = k_cache.shape[2]
    H = weights["q_proj"].shape[0] // num_heads
    K = weights["k_proj"].shape[0] // H
    q = rearrange(x @ weights["q_proj"].T, "B T (N H) -> B N T H", N=num_heads)
    k = rearrange(x @ weights["k_proj"].T, "B T (K H) -> B K T H", K=K)
    v = rearrange(x @ weights["v_proj"].T, "B T (K H) -> B K T H", K=K)
    cos, sin = _layers.rope_angles(H, S + T, rope_theta, device=x.device)
    q = _layers.apply_rope(q, cos[S:], sin[S:])          # positions S .. S + T - 1
    k = _layers.apply_rope(k, cos[S:], sin[S:])
    keys = torch.cat([k_cache, k], dim=2)                 # (B, K, S + T, H)
    values = torch.cat([v_cache, v], dim=2)
    mask = _attention.attention_mask(T, S + T, S, device=x.device)
    out = _attention.grouped_attention(q, keys, values, mask)
    return rearrange(out, "B N T H -> B T (N H)") @ weights["output_proj"].T, keys, values


@graded("attention")
def mla_absorbed_attention(q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                           w_uk: torch.Tensor, w_uv: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Multi-head latent attention (DeepSeek-V2) over the cached latents, absorbed form.

    q_nope: (B, N, T, H) content queries; q_rope: (B, N, T, R) rotated queries; latent: (B, S, C) cached
    latents c; k_rope: (B, S, R) cached rotated key shared by all heads; w_uk, w_uv: (N H, C), the
    up-projections (head n's key is W_UK[nH:(n+1)H] c, its value W_UV[nH:(n+1)H] c); mask: (T, S) bool
    (True = may attend) or None.
    Returns (B, N, T, H): for each head n, softmax((q_nope_n . k_n + q_rope_n . k_rope) / sqrt(H + R)) v_n,
    computed without materialising per-head keys or values: fold W_UK into the query
    (q_nope_n . W_UK,n c = (W_UK,n^T q_nope_n) . c), attend over c directly, apply W_UV,n after.
    """
    cached = torch.cat([latent, k_rope], dim=-1)[:, None]      # (B, 1, S, C + R): one shared key head
    if mask is not None:
        mask = mask.reshape(1, 1, *mask.shape[-2:])
    return _mla.absorbed_attention(q_nope, q_rope, cached, w_uk, w_uv, mask)


@graded("attention")
def sliding_window_mask(num_new: int, start: int, window: int) -> torch.Tensor:
    """The mask of sliding-window attention (Mistral 7B) for T = num_new queries at positions
    start .. start + T - 1 over the keys at positions 0 .. start + T - 1.

    Returns (T, start + T) bool: query i may attend to key j iff j <= i and i - j < window
    (each query sees itself and the window - 1 positions before it).
    """
    mask = _attention.attention_mask(num_new, start + num_new, start, window=window)
    if mask is None:   # the library's fast path: every key visible
        return torch.ones(num_new, start + num_new, dtype=torch.bool)
    return mask[0, 0]


@graded("attention")
class RollingKVBuffer:
    """A sliding-window layer's keys and values in a ring of `capacity` slots (Mistral 7B).

    Position p lives in slot p % capacity, so memory stays flat however long the sequence grows. A query at
    position i attends to positions i - window + 1 .. i. capacity >= window; the capacity - window spare
    slots let `truncate` roll back (speculative decoding rejects drafts) even after the ring has wrapped.
    Attribute `length` (int): the number of positions appended so far (after rollbacks).
    """

    def __init__(self, batch_size: int, num_kv_heads: int, head_dim: int, window: int, capacity: int):
        """An empty buffer for keys/values of shape (B, K, ., H); window >= 1, capacity >= window."""
        if capacity < window:
            raise ValueError(f"capacity must be >= window ({window}), got {capacity}")
        self._ring = _rolling.RollingKVCache(batch_size, num_kv_heads, head_dim, window, sys.maxsize,
                                             spare=capacity - window)
        self.window, self.capacity, self.length = window, capacity, 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (B, K, T, H) at positions length .. length + T - 1 (slot p % capacity; when T exceeds
        capacity only the last `capacity` positions remain). Then length += T."""
        step = CacheStep(self.length, k.shape[2])
        self._ring.update(k, v, step)
        self._ring.commit(step)
        self.length = step.end

    def context(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, K, W', H) of positions max(0, length - window + 1) .. length - 1, oldest
        first: what a query at position `length` attends to besides itself (W' = min(window - 1, length))."""
        first = max(0, self.length - self.window + 1)
        k, v = self._ring.read(self.length)                  # positions oldest .. length - 1
        skip = first - (self.length - k.shape[2])
        return k[:, :, skip:], v[:, :, skip:]

    def truncate(self, n: int) -> None:
        """Roll back to the first n positions (0 <= n <= length). Raise ValueError and change nothing if a
        position that `context()` would then return was overwritten in the ring (by any append since it
        was written, including appends that were rolled back)."""
        if not isinstance(n, int) or not 0 <= n <= self.length:
            raise ValueError(f"n must be an int in [0, {self.length}], got {n!r}")
        self._ring.truncate(n)
        self.length = n


# --- quantization -------------------------------------------------------------------------------


@graded("quantization")
def quantize(x: torch.Tensor, scale, zero_point, bits: int, symmetric: bool) -> torch.Tensor:
    """q = clamp(round(x / scale) + zero_point, qmin, qmax) as integer codes (round half to even, as
    torch.round).

    x: (..., I) float. scale, zero_point: numbers, or tensors of shape (R, G) for x of R rows (all leading
    dims flattened) whose I columns form G groups of I / G consecutive elements (one scale per group).
    Code range: symmetric -> signed [-2^(bits-1), 2^(bits-1) - 1]; else unsigned [0, 2^bits - 1].
    Returns an integer tensor shaped like x.
    """
    return _core.quantize(x, scale, zero_point, bits, symmetric)


@graded("quantization")
def dequantize(q: torch.Tensor, scale, zero_point) -> torch.Tensor:
    """x_hat = (q - zero_point) * scale in float32; scale/zero_point as in `quantize`. Returns q's shape."""
    return _core.dequantize(q, scale, zero_point)


@graded("quantization")
def quantize_tensor(x: torch.Tensor, bits: int = 8, symmetric: bool = True, granularity: str = "tensor",
                    group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest quantization of x (..., I) with scales from its own range.

    granularity: "tensor" (one scale), "channel" (one per row: every leading index), "group" (one per
    `group_size` consecutive elements of a row). Per group of values:
      symmetric (absmax): scale = max|x| / (2^(bits-1) - 1), zero_point = 0;
      affine (min/max): lo = min(min x, 0), hi = max(max x, 0) (so 0.0 is exact),
        scale = (hi - lo) / (2^bits - 1), zero_point = clamp(-round(lo / scale), 0, 2^bits - 1);
      a scale of 0 (an all-zero group) becomes 1. Scales are computed in float32.
    Returns (codes (..., I) integer, scale, zero_point): scale/zero_point () for "tensor", (R, G) otherwise
    (R rows, G groups per row; G = 1 for "channel"), as `quantize` takes them.
    """
    qt = _core.quantize_tensor(x, bits, symmetric, granularity, group_size)
    return qt.q, qt.scale, qt.zero_point


@graded("quantization")
def pack_int4(q: torch.Tensor, signed: bool = True) -> torch.Tensor:
    """Two 4-bit codes per byte: q (..., I) integer in [-8, 7] (signed, two's complement nibbles) or
    [0, 15]; I even. Returns uint8 (..., I / 2): byte i holds element 2i in its low nibble and 2i + 1 in
    its high nibble."""
    return _packing.pack_int4(q, signed)


@graded("quantization")
def unpack_int4(packed: torch.Tensor, signed: bool = True) -> torch.Tensor:
    """The inverse of `pack_int4`: uint8 (..., I / 2) -> int8 (..., I)."""
    return _packing.unpack_int4(packed, signed)


@graded("quantization")
def quantize_kv_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 KV cache's encoding: one absmax scale per (sequence, head, position) vector of H values.

    x: (B, K, S, H) float keys or values. Returns (codes (B, K, S, H) int8, scale (B, K, S, 1) float16):
    scale = max|x| over H / 127, rounded to float16 (how the cache stores it), at least float16's smallest
    normal number (torch.finfo(torch.float16).tiny: an all-zero vector must not divide by 0);
    codes = round(clamp(x / scale, -127, 127)) with that stored scale, so codes * scale decodes x.
    """
    B, K, S, H = x.shape
    return _kv.QuantizedKVCache(B, K, H, 1, device=x.device, fmt="int8")._encode(x)


@graded("quantization")
def llm_int8_matmul(x: torch.Tensor, weight: torch.Tensor, threshold: float | None = 6.0) -> torch.Tensor:
    """LLM.int8() (Dettmers et al. 2022): y = x W^T with vector-wise int8 and outlier decomposition.

    x: (T, I) float; weight: (O, I) float. Returns (T, O) float32.
    Outlier columns: input features j where some |x[t, j]| > threshold (strictly); threshold None = none.
    They are multiplied in full precision: x[:, outliers] @ W[:, outliers]^T. The other columns go through
    int8: each row of x (restricted to those columns) and each row of W (all I columns) gets an absmax
    scale s = max|row| / 127; codes round(row / s) in [-127, 127]; the int8 x int8 products are summed
    exactly (int32) and rescaled by s_x[t] * s_w[o]. y is the sum of the two parts.
    """
    return _llm_int8.llm_int8_matmul(x, weight, threshold)


@graded("quantization")
def gptq_quantize(weight: torch.Tensor, inputs: torch.Tensor, bits: int = 4,
                  group_size: int | None = None) -> torch.Tensor:
    """GPTQ (Frantar et al. 2023): quantize weight (O, I) column by column, pushing each column's rounding
    error onto the columns not yet quantized. Returns W_hat (O, I) float32, the dequantized weights.

    inputs: (n, I) calibration inputs X; H = 2 X^T X / n in float64 (inputs j with H[j, j] = 0 never fire:
    set H[j, j] = 1 and W[:, j] = 0), dampened: H += 0.01 * mean(diag H) * identity.
    For j = 0 .. I - 1 (in order), with Hinv_j = inverse of H restricted to columns j .. I - 1:
      q_j = dequantize(quantize(w_j)) with the current (error-updated) weights;
      w_{j+1:} -= (w_j - q_j) / Hinv_j[0, 0] * Hinv_j[0, 1:]   (the optimal compensation).
    Quantizer: affine min/max (as `quantize_tensor`, affine), one scale and zero point per row of each
    group of `group_size` columns (None: the whole row), computed in float32 from the error-updated
    weights when the group's first column is reached.
    """
    result = _gptq.gptq_quantize(weight, inputs=inputs, bits=bits, group_size=group_size)
    return result.quantized.dequantize(torch.float32)


# --- serving: paged KV memory, continuous batching ------------------------------------------------


@graded("serving")
class BlockAllocator:
    """The physical KV blocks of paged attention (vLLM, Kwon et al. 2023): block ids 0 .. num_blocks - 1 of
    `block_size` token slots each. A block is free, or held by one or more block tables (its reference
    count: more than one when sequences share a prefix or were forked).
    Attribute (or property) `num_free` (int): how many blocks are free.
    """

    def __init__(self, num_blocks: int, block_size: int):
        """All num_blocks blocks free."""
        self._blocks = _serving.BlockAllocator(num_blocks, block_size)

    @property
    def num_free(self) -> int:
        return self._blocks.num_free

    def allocate(self) -> int:
        """A free block, now held once. When none is free raise a RuntimeError and change nothing."""
        return self._blocks.allocate()

    def incref(self, block: int) -> None:
        """One more table holds `block` (which must be in use: a free block raises ValueError)."""
        self._blocks.incref(block)

    def free(self, block: int) -> bool:
        """One holder lets go of `block`; True when that was the last (the block is free again). Freeing a
        block that is already free raises ValueError and changes nothing."""
        return self._blocks.free(block)

    def ref_count(self, block: int) -> int:
        """How many tables hold `block` (0: free)."""
        return self._blocks.ref_count(block)


@graded("serving")
def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: list[list[int]],
                    context_lens: list[int], query_lens: list[int]) -> torch.Tensor:
    """Causal attention of a ragged batch whose keys and values sit in blocks scattered over one pool.

    q: (sum of T_b, N, H), the new tokens' queries, sequence after sequence; sequence b's T_b queries are
    its positions S_b - T_b .. S_b - 1. k_pool, v_pool: (num_blocks, block_size, K, H). block_tables[b]:
    the physical blocks of sequence b, in order: position p lives in block block_tables[b][p // block_size]
    at slot p % block_size. context_lens[b] = S_b (keys of sequence b, its new ones included);
    query_lens[b] = T_b. GQA: query head n reads key/value head n // (N / K). Returns (sum of T_b, N, H):
    each query attends (softmax of q k / sqrt(H)) to its own sequence's positions <= its own.
    """
    return _serving.paged_attention(q, k_pool, v_pool, block_tables, context_lens, query_lens)


@graded("serving")
def continuous_batching_step(running: list[tuple[int, int]], waiting: list[tuple[int, int]], num_blocks: int,
                             block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                             watermark_blocks: int) -> dict[str, list[int] | int]:
    """One step of continuous (iteration-level) batching over paged KV memory (Orca; vLLM), no prefix caching.

    running: (seq_id, num_tokens) of each running sequence in admission order (oldest first); it holds
    ceil(num_tokens / block_size) blocks and this step appends one token to it (a decode), which takes a
    new block when its blocks are full. waiting: (seq_id, num_tokens) in queue order; admitting one takes
    ceil(num_tokens / block_size) blocks (a prefill of all its tokens). The other blocks of the
    num_blocks are free. The step:
    1. decodes, oldest first: if the sequence needs a block and none is free, preempt the youngest running
       sequence not yet given its decode slot (it frees all its blocks and goes back to the front of the
       waiting queue), and repeat; if that youngest one is the sequence itself, it is preempted instead;
    2. if nothing was preempted, admit waiting sequences in order while all of these hold, stopping at
       the first that fails: running + admitted sequences stay <= max_num_seqs; the step's tokens (1 per
       decode + num_tokens per prefill) stay <= max_num_batched_tokens (the first prefill of a step with no
       decodes is always allowed); its blocks + watermark_blocks <= the free blocks.
    Returns {"decodes": seq ids, "prefills": seq ids, "preempted": seq ids in the order preempted,
    "waiting": the queue after the step, "num_free_blocks": free blocks after the step}.
    """
    manager = _serving.BlockManager(num_blocks, block_size, prefix_caching=False)
    scheduler = _serving.ContinuousScheduler(manager, max_num_seqs, max_num_batched_tokens, watermark_blocks)

    def sequence(seq_id, num_tokens):
        request = _serving.Request(seq_id, tuple(range(1, num_tokens + 1)), max_new_tokens=1)
        return _serving.Sequence(seq_id, request)
    for seq_id, num_tokens in running:
        seq = sequence(seq_id, num_tokens)
        manager.allocate(seq_id, seq.token_ids)
        seq.num_computed, seq.status = num_tokens - 1, _serving.SequenceStatus.RUNNING
        scheduler.running.append(seq)
    for seq_id, num_tokens in waiting:
        scheduler.waiting.append(sequence(seq_id, num_tokens))
    batch = scheduler.schedule(now=0.0)
    return {"decodes": [s.seq_id for s in batch.decodes], "prefills": [s.seq_id for s in batch.prefills],
            "preempted": [s.seq_id for s in batch.preempted], "waiting": [s.seq_id for s in scheduler.waiting],
            "num_free_blocks": manager.num_free_blocks}


# --- accounting: numeric and symbolic ------------------------------------------------------------

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


# --- data ---------------------------------------------------------------------------------------


@graded("data")
def get_batch(data: torch.Tensor, batch_size: int, seq_len: int,
              generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """B = batch_size random training windows of a 1-D token stream `data` (numel >= seq_len + 1).

    Each start s is drawn uniformly from every valid start 0 .. numel - seq_len - 1 (with `generator`).
    Returns (x, y), both (B, T = seq_len) int64: x = data[s : s + T], y = data[s + 1 : s + T + 1].
    """
    return _corpus.get_batch(data, batch_size, seq_len, generator)
