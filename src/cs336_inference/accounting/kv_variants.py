"""The KV-cache variants of lecture section `reduce_kv_cache_size` at real scale (accounting only).

Each variant (GQA, MQA, MLA, a sliding window, a local/global hybrid, cross-layer sharing) applied to
the attention of Llama 2 13B (MHA, 40 layers of 40 heads x 128 dims) and of DeepSeek-V2 (MLA, 60
layers of 128 heads x 128 dims), from `model_shapes.REAL_MODELS`; `cache_bytes_vs_context` is one
sequence's cache bytes (`formulas.kv_cache_bytes`) as the context grows, where a window goes flat.
"""

from __future__ import annotations

from .formulas import kv_cache_bytes
from .model_shapes import REAL_MODELS, ModelShape

_GQA = dict(attention_type="gqa", kv_lora_rank=None, rope_head_dim=None)   # undoes DeepSeek-V2's MLA
SCALE_VARIANTS = {
    "MHA": _GQA,
    "GQA (K=8)": dict(_GQA, num_kv_heads=8),
    "MQA (K=1)": dict(_GQA, num_kv_heads=1),
    "MLA (C=512, R=64)": dict(attention_type="mla", kv_lora_rank=512, rope_head_dim=64),
    "window 4096": dict(_GQA, sliding_window=4096),
    "hybrid (window 1024, 1 global in 6) + GQA (K=8)": dict(_GQA, num_kv_heads=8, sliding_window=1024, global_every=6),
    "CLA (2 layers) + GQA (K=8)": dict(_GQA, num_kv_heads=8, kv_share_group=2),
}
SCALE_MODELS = {"Llama-2-13B": "llama2-13b", "DeepSeek-V2": "deepseek-v2"}


def scale_shapes(model: str) -> dict[str, ModelShape]:
    """Each variant applied to a real model's attention shape (its heads, head dim and layers)."""
    base = REAL_MODELS[model]
    return {name: base.replace(name=f"{base.name} {name}", num_kv_heads=kw.get("num_kv_heads", base.num_heads),
                               **{k: v for k, v in kw.items() if k != "num_kv_heads"})
            for name, kw in SCALE_VARIANTS.items()}


def cache_bytes_vs_context(lengths, bytes_per_element: int = 2) -> dict:
    """{model title: {variant: KV-cache bytes of one sequence at each length}} (bf16 by default)."""
    return {title: {name: [kv_cache_bytes(shape, 1, int(S), bytes_per_element) for S in lengths]
                    for name, shape in scale_shapes(model).items()}
            for title, model in SCALE_MODELS.items()}


__all__ = ["SCALE_MODELS", "SCALE_VARIANTS", "cache_bytes_vs_context", "scale_shapes"]
