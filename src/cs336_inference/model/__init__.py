"""The model: config, layers, attention variants, KV caches, `TransformerLM`, checkpoints, tokenizers.

One concept per file: `config` (ModelConfig), `layers` (RMSNorm, SwiGLU, RoPE, Linear),
`attention` (kernels and masks), `gqa` / `mla` / `window` (one attention variant each),
`kv_cache` (the layer-cache interface, the contiguous cache and the model's cache),
`rolling_kv_cache` / `latent_kv_cache` (the sliding-window and MLA layer caches), `transformer` (TransformerLM),
`variants` (the handout's ablations: SiLU FFN, QK-norm, NoPE, no norms),
`checkpoints` (save/load, shipped models, student checkpoints; `checkpoint_keys`: key maps for
students' own layouts; `key_inference`: key_map="auto"; `checkpoint_hints`: what to pass when a checkpoint
does not match; `verify`: the loaded model against the student's own forward), `tokenizer` (bytes; `load_tokenizer`),
`bpe_tokenizer` (a real model's byte-level BPE), `gguf` (llama.cpp files -> config, CS336 state dict,
tokenizer), `real_models` (SmolLM2-135M from its installed package, cached on disk), `convert`
(post-hoc attention changes of a trained model).
"""

from .attention import attention_mask, grouped_attention, scaled_dot_product_attention
from .checkpoint_keys import COMMON_RENAMES, rename_keys, split_fused_gate_up, split_fused_qkv
from .checkpoints import available_pretrained, load, load_cs336_checkpoint, load_pretrained, save
from .key_inference import AutoKeyMapError, InferredKeyMap, infer_key_map
from .verify import CheckpointMismatchError, verify_checkpoint
from .config import PRESETS, ModelConfig
from .gqa import GroupedQueryAttention
from .kv_cache import CacheStep, ContiguousKVCache, ForwardStep, KVCache, LayerCache
from .latent_kv_cache import LatentKVCache
from .rolling_kv_cache import RollingKVCache
from .layers import RMSNorm, RotaryEmbedding, SwiGLU, apply_rope, rope_angles
from .mla import MultiHeadLatentAttention
from .bpe_tokenizer import BPETokenizer
from .real_models import REAL_MODELS
from .tokenizer import ByteTokenizer, load_tokenizer
from .transformer import PostNormBlock, TransformerBlock, TransformerLM
from .variants import QKNorm, SiLUFeedForward, WeightlessQKNorm, no_rope
from .window import SlidingWindowAttention

__all__ = [
    "AutoKeyMapError", "BPETokenizer", "COMMON_RENAMES", "CheckpointMismatchError", "InferredKeyMap",
    "ByteTokenizer", "CacheStep", "ContiguousKVCache", "ForwardStep", "GroupedQueryAttention",
    "KVCache", "LatentKVCache", "LayerCache", "ModelConfig", "MultiHeadLatentAttention", "PRESETS",
    "PostNormBlock", "QKNorm", "SiLUFeedForward", "WeightlessQKNorm", "no_rope",
    "REAL_MODELS", "RMSNorm", "RollingKVCache", "RotaryEmbedding",
    "SlidingWindowAttention", "SwiGLU", "TransformerBlock", "TransformerLM", "apply_rope", "attention_mask",
    "available_pretrained", "grouped_attention", "infer_key_map",
    "load", "load_cs336_checkpoint", "load_pretrained", "load_tokenizer",
    "rename_keys", "rope_angles", "save", "scaled_dot_product_attention", "split_fused_gate_up", "split_fused_qkv",
    "verify_checkpoint",
]
