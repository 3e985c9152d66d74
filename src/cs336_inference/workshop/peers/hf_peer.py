"""The peer for decode benchmarks: Hugging Face's `LlamaForCausalLM` holding our model's weights.

Bench- and test-only, from the optional extra: `pip install -e ".[peer]"` (transformers is large, so
`.ci/setup` leaves it out unless CS336_PEER=1). Without it the benchmark prints why it skips the row.

Our `TransformerLM` is a Llama: pre-norm RMSNorm, SwiGLU (w1 = gate, w3 = up, w2 = down), no
biases, lm_head untied or tied to the embedding table (SmolLM2; HF's `tie_word_embeddings`). One
layout differs: CS336 rotates *adjacent* pairs (x[2k], x[2k+1]) while HF rotates the two halves
(x[k], x[k + H/2]). Permuting each head's q and k rows from [0, 1, 2, 3, ...] to
[0, 2, 4, ..., 1, 3, 5, ...] turns one into the other, and q.k is unchanged
by permuting both the same way, so the converted model computes the same function.
"""

from __future__ import annotations

import inspect

import torch
from einops import rearrange

INSTALL_HINT = 'pip install -e ".[peer]"  (Hugging Face transformers, bench/test only)'


def transformers_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _rotate_half_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(n * H, D) rows of q_proj / k_proj: adjacent-pair RoPE layout -> rotate-half layout, per head."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    return rearrange(rearrange(w, "(n H) D -> n H D", H=head_dim)[:, order], "n H D -> (n H) D")


def hf_llama_from(model, dtype: torch.dtype | None = None):
    """A `transformers.LlamaForCausalLM` with `model`'s weights (same device; dtype default: model's)."""
    if not transformers_available():
        raise ImportError(f"the Hugging Face peer needs transformers: {INSTALL_HINT}")
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = model.config
    if cfg.attention_type != "gqa" or cfg.sliding_window is not None or cfg.kv_share_group != 1:
        raise ValueError("the Llama peer covers plain GQA/MHA models (no MLA, sliding window or cross-layer "
                         "sharing)")
    state = model.state_dict()   # CS336 keys (a fused model saves them too)
    if not all(isinstance(v, torch.Tensor) and v.is_floating_point() for v in state.values()):
        raise ValueError("the peer needs a full-precision model (quantized layers have no Llama equivalent)")
    H = cfg.head_dim
    hf_config = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                            num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                            num_key_value_heads=cfg.num_kv_heads, head_dim=H,
                            max_position_embeddings=cfg.context_length, rms_norm_eps=cfg.norm_eps,
                            rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings, attention_bias=False,
                            mlp_bias=False, bos_token_id=None, eos_token_id=None)   # no stop token: HF
    # would otherwise treat id 2 as end-of-sequence and suppress it while generating
    hf_state = {"model.embed_tokens.weight": state["token_embeddings.weight"],
                "model.norm.weight": state["ln_final.weight"], "lm_head.weight": state["lm_head.weight"]}
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        hf_state |= {
            theirs + "self_attn.q_proj.weight": _rotate_half_rows(state[ours + "attn.q_proj.weight"], H),
            theirs + "self_attn.k_proj.weight": _rotate_half_rows(state[ours + "attn.k_proj.weight"], H),
            theirs + "self_attn.v_proj.weight": state[ours + "attn.v_proj.weight"],
            theirs + "self_attn.o_proj.weight": state[ours + "attn.output_proj.weight"],
            theirs + "mlp.gate_proj.weight": state[ours + "ffn.w1.weight"],
            theirs + "mlp.up_proj.weight": state[ours + "ffn.w3.weight"],
            theirs + "mlp.down_proj.weight": state[ours + "ffn.w2.weight"],
            theirs + "input_layernorm.weight": state[ours + "ln1.weight"],
            theirs + "post_attention_layernorm.weight": state[ours + "ln2.weight"],
        }
    hf = LlamaForCausalLM(hf_config).to(model.device)
    hf.load_state_dict(hf_state, strict=True)
    return hf.to(dtype or model.dtype).eval()


def _cache_kwarg(hf) -> str:
    """transformers 5 calls the KV cache argument `cache`; earlier versions `past_key_values`."""
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


@torch.inference_mode()
def hf_decode_step_fn(hf, batch_size: int, context: int = 32):
    """Prefill `context` random tokens into a fresh `DynamicCache`; return a function running one
    decode step (one token per sequence), as `decode_one_token` does for our model."""
    from transformers.cache_utils import DynamicCache

    device = next(hf.parameters()).device
    key = _cache_kwarg(hf)
    cache = DynamicCache()
    ids = torch.randint(0, hf.config.vocab_size, (batch_size, context), device=device)
    hf(input_ids=ids, use_cache=True, **{key: cache})
    token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)

    def step():
        with torch.inference_mode():
            return hf(input_ids=token, use_cache=True, logits_to_keep=1, **{key: cache}).logits[:, -1]
    return step


@torch.inference_mode()
def hf_greedy(hf, prompt_ids: torch.Tensor, max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation of equal-length prompts (B, T) by HF's own `generate` (no early stop)."""
    # an explicit all-ones mask: otherwise HF treats prompt tokens equal to pad_token_id as padding
    out = hf.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=max_new_tokens,
                      do_sample=False, pad_token_id=0)
    return out[:, prompt_ids.shape[1]:].tolist()
