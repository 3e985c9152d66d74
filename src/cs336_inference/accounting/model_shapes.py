"""`ModelShape`: the sizes of a real model, for accounting only (nothing here is ever built).

Real models do not always fit `ModelConfig` (DeepSeek-V2 has 128 heads of 128 dims on
D = 5120, so H != D / N, and mixture-of-experts MLPs), so their shapes live in this small
dataclass; `ModelShape.from_config` turns any `ModelConfig` into one, so every accounting
function takes either.

Sources: Llama 2 (Touvron et al. 2023, arXiv:2307.09288, Table 1, and the released
config.json files), Llama 3 (Grattafiori et al. 2024, "The Llama 3 Herd of Models",
arXiv:2407.21783, Table 3), DeepSeek-V2 (DeepSeek-AI 2024, arXiv:2405.04434, Section 3.1 and
Appendix; 236B parameters, 21B active per token).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .. import _checks
from ..model.config import ATTENTION_TYPES, ModelConfig


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab_size: int            # V
    d_model: int               # D
    num_layers: int            # L
    num_heads: int             # N
    num_kv_heads: int          # K (MLA: unused for the cache; set to N)
    head_dim: int              # H (MLA: the non-RoPE query/key dim and the value dim per head)
    d_ff: int                  # F of the dense MLP layers
    context_length: int
    source: str = ""
    attention_type: str = "gqa"        # "gqa" (MHA/GQA/MQA) or "mla"
    kv_lora_rank: int | None = None    # C, MLA latent
    q_lora_rank: int | None = None     # MLA query compression (None: full-rank query)
    rope_head_dim: int | None = None   # MLA decoupled RoPE dims
    latent_norms: bool = False         # MLA: RMSNorm on the q and kv latents (DeepSeek's checkpoints)
    sliding_window: int | None = None
    global_every: int | None = None
    attention_sinks: int = 0           # first positions a local layer keeps beyond its window
    tie_embeddings: bool = False       # lm_head shares the embedding table (SmolLM2)
    kv_share_group: int = 1            # CLA: layers per shared KV cache
    # Mixture of experts (DeepSeekMoE): 0 experts means every MLP is dense with d_ff.
    num_experts: int = 0               # routed experts per MoE layer
    num_shared_experts: int = 0        # always-active experts per MoE layer
    experts_per_token: int = 0         # routed experts each token activates
    moe_d_ff: int | None = None        # hidden size of one expert
    first_dense_layers: int = 0        # leading layers that keep a dense MLP

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "d_ff", "context_length", "kv_share_group"):
            _checks.positive_int(name, getattr(self, name))
        for name in ("kv_lora_rank", "q_lora_rank", "rope_head_dim", "sliding_window", "global_every",
                     "moe_d_ff"):
            _checks.optional_positive_int(name, getattr(self, name))
        for name in ("num_experts", "num_shared_experts", "experts_per_token", "first_dense_layers"):
            _checks.non_negative_int(name, getattr(self, name))
        _checks.one_of("attention_type", self.attention_type, ATTENTION_TYPES)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if self.attention_type == "mla" and (self.kv_lora_rank is None or self.rope_head_dim is None):
            raise ValueError("attention_type='mla' needs kv_lora_rank (C) and rope_head_dim")
        if self.num_layers % self.kv_share_group != 0:
            raise ValueError(f"kv_share_group ({self.kv_share_group}) must divide num_layers ({self.num_layers})")
        if self.num_experts and (self.moe_d_ff is None or not 0 < self.experts_per_token <= self.num_experts):
            raise ValueError("a mixture of experts needs moe_d_ff and 0 < experts_per_token <= num_experts")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> "ModelShape":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_config(cls, config: ModelConfig, name: str = "config") -> "ModelShape":
        """The shape of a buildable `ModelConfig` (H = D / N, dense SwiGLU MLPs)."""
        _checks.instance("config", config, ModelConfig, "a ModelConfig")
        if config.mixer != "attention":
            raise ValueError(f"the transformer accounting counts attention layers; mixer={config.mixer!r} has "
                             f"fixed-state layers, whose state bytes `accounting.fixed_state` counts")
        return cls(name=name, vocab_size=config.vocab_size, d_model=config.d_model,
                   num_layers=config.num_layers, num_heads=config.num_heads,
                   num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, d_ff=config.d_ff,
                   context_length=config.context_length, source="ModelConfig",
                   attention_type=config.attention_type, kv_lora_rank=config.kv_lora_rank,
                   q_lora_rank=config.q_lora_rank, rope_head_dim=config.rope_head_dim,
                   sliding_window=config.sliding_window, global_every=config.global_every,
                   attention_sinks=config.attention_sinks, kv_share_group=config.kv_share_group,
                   tie_embeddings=config.tie_embeddings)




_LLAMA2 = "Touvron et al. 2023, Llama 2 (arXiv:2307.09288) Table 1 and the released config.json"
_LLAMA3 = "Grattafiori et al. 2024, The Llama 3 Herd of Models (arXiv:2407.21783) Table 3; V = 128256 from config.json"
REAL_MODELS: dict[str, ModelShape] = {
    # The lecture's running example: MHA (K = N = 40), 13.0B parameters.
    "llama2-13b": ModelShape("llama2-13b", vocab_size=32000, d_model=5120, num_layers=40, num_heads=40,
                             num_kv_heads=40, head_dim=128, d_ff=13824, context_length=4096, source=_LLAMA2),
    "llama2-70b": ModelShape("llama2-70b", vocab_size=32000, d_model=8192, num_layers=80, num_heads=64,
                             num_kv_heads=8, head_dim=128, d_ff=28672, context_length=4096, source=_LLAMA2),
    "llama3-8b": ModelShape("llama3-8b", vocab_size=128256, d_model=4096, num_layers=32, num_heads=32,
                            num_kv_heads=8, head_dim=128, d_ff=14336, context_length=8192, source=_LLAMA3),
    "llama3-70b": ModelShape("llama3-70b", vocab_size=128256, d_model=8192, num_layers=80, num_heads=64,
                             num_kv_heads=8, head_dim=128, d_ff=28672, context_length=8192, source=_LLAMA3),
    # MLA: cache a 512-dim latent plus a 64-dim shared RoPE key per token per layer; 128 heads of
    # 128 dims; DeepSeekMoE with 2 shared + 160 routed experts (6 active) of 1536 hidden units,
    # except a dense first layer (F = 12288).
    "deepseek-v2": ModelShape("deepseek-v2", vocab_size=102400, d_model=5120, num_layers=60, num_heads=128,
                              num_kv_heads=128, head_dim=128, d_ff=12288, context_length=131072,
                              source="DeepSeek-AI 2024, DeepSeek-V2 (arXiv:2405.04434) Sec. 3.1 and the "
                                     "released config.json",
                              attention_type="mla", kv_lora_rank=512, q_lora_rank=1536, rope_head_dim=64,
                              latent_norms=True,
                              num_experts=160, num_shared_experts=2, experts_per_token=6, moe_d_ff=1536,
                              first_dense_layers=1),
}


def get_model_shape(model: str | ModelShape | ModelConfig) -> ModelShape:
    """A `ModelShape` from a name in `REAL_MODELS`, a `ModelConfig`, or a shape passed through."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, ModelConfig):
        return ModelShape.from_config(model)
    if isinstance(model, str) and model.lower() in REAL_MODELS:
        return REAL_MODELS[model.lower()]
    raise ValueError(f"unknown model {model!r}; pass a ModelConfig, a ModelShape or one of {sorted(REAL_MODELS)}")
