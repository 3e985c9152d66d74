"""Post-hoc changes to a trained model's attention, without any training: the KV-cache lecture's
variants applied to a real model as it was trained, to measure what each cut costs.

`with_attention(model, ...)`: the same parameters (shared, not copied) under another attention
config: a sliding window (Longformer, Mistral), local/global hybrids (Gemma 2, Character.AI), attention
sinks (StreamingLLM). None of them changes a weight's shape, only what each query may see.
`mean_pool_kv_heads(model, K)`: GQA's conversion of a checkpoint to fewer key/value heads (Ainslie et
al. 2023, Sec. 2.1): each new K/V projection is the mean of the old heads it replaces. The paper then
uptrains for ~5% of the pre-training steps; without that step the converted model shows how much the
heads differ.
"""

from __future__ import annotations

from einops import reduce

from .checkpoints import from_state_dict
from .transformer import TransformerLM

ATTENTION_KNOBS = ("sliding_window", "global_every", "attention_sinks")


def _check_model(model) -> None:
    if not isinstance(model, TransformerLM):
        raise TypeError(f"model must be a TransformerLM, got {type(model).__name__}")


def _same_kernel(new: TransformerLM, model: TransformerLM) -> TransformerLM:
    """The converted model computes attention with the kernel the original was set to."""
    return new.set_attention_kernel(getattr(model.layers[0].attn, "attention_kernel", "reference"))


def with_attention(model: TransformerLM, **changes) -> TransformerLM:
    """`model` with other sliding_window / global_every / attention_sinks settings, sharing its weights.

    with_attention(m, sliding_window=256, attention_sinks=4); with_attention(m, sliding_window=None)
    undoes a window. Everything is checked (by `ModelConfig`) before anything is built.
    """
    _check_model(model)
    unknown = sorted(set(changes) - set(ATTENTION_KNOBS))
    if unknown:
        raise ValueError(f"with_attention changes only {ATTENTION_KNOBS} (no weight changes shape); got {unknown}")
    if model.config.attention_type != "gqa":
        raise ValueError(f"with_attention needs attention_type='gqa', got {model.config.attention_type!r}")
    if "sliding_window" in changes and changes["sliding_window"] is None:  # back to global: drop its knobs
        changes = {"global_every": None, "attention_sinks": 0, **changes}
    config = model.config.replace(**changes)
    new = from_state_dict(config, model.state_dict(), device=model.device, dtype=model.dtype, copy=False)
    return _same_kernel(new, model)


def mean_pool_kv_heads(model: TransformerLM, num_kv_heads: int) -> TransformerLM:
    """A model with `num_kv_heads` K/V heads (1 = MQA) whose K/V projections average each group of
    adjacent old heads; every other weight is shared with `model`, not copied.

    Query head n used old K/V head n // G; with G' = N / num_kv_heads it now uses n // G', the mean of
    the old heads that its queries' old heads are pooled into (adjacent heads pool together).
    """
    _check_model(model)
    config = model.config
    if config.attention_type != "gqa":
        raise ValueError(f"mean_pool_kv_heads needs attention_type='gqa', got {config.attention_type!r}")
    K = config.num_kv_heads
    if isinstance(num_kv_heads, bool) or not isinstance(num_kv_heads, int) or num_kv_heads <= 0 or K % num_kv_heads:
        raise ValueError(f"num_kv_heads must be a positive divisor of the model's {K} K/V heads, got {num_kv_heads!r}")
    state = model.state_dict()
    for key in [k for k in state if k.endswith(("attn.k_proj.weight", "attn.v_proj.weight"))]:
        pooled = reduce(state[key].float(), "(K g H) D -> (K H) D", "mean", K=num_kv_heads, H=config.head_dim)
        state[key] = pooled.to(state[key].dtype)
    new = from_state_dict(config.replace(num_kv_heads=num_kv_heads), state, device=model.device,
                          dtype=model.dtype, copy=False)
    return _same_kernel(new, model)
