"""`ModelConfig`: every knob of the reference `TransformerLM`, validated, with named presets.

The base fields are exactly those of the CS336 assignment-1 model; `num_kv_heads` (GQA) and the
attention-variant knobs below are the extensions this course adds for the KV-cache lecture.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .. import _checks

ATTENTION_TYPES = ("gqa", "mla")  # gqa covers MHA (K = N) and MQA (K = 1)
MIXERS = ("attention", "linear", "ssd")   # what mixes tokens: attention (a KV cache) or a fixed-state layer
# The assignment-1 handout's ablations (its base model is the first value of each).
NORM_POSITIONS = ("pre", "post")
NORMS = ("rmsnorm", "none")
POSITIONALS = ("rope", "none")
FFNS = ("swiglu", "silu")
QK_NORMS = ("none", "gain", "no_gain")
NORM_EPS_FIELDS = ("ln1_eps", "ln2_eps", "ln_final_eps", "qk_norm_eps")


@dataclass
class ModelConfig:
    vocab_size: int = 257          # V: 256 bytes + <|endoftext|> for the ByteTokenizer
    context_length: int = 256      # longest sequence the model (and its RoPE table) supports
    d_model: int = 128             # D
    num_layers: int = 4            # L
    num_heads: int = 4             # N query heads; head_dim H = D / N
    num_kv_heads: int | None = None  # K key/value heads (None -> N, i.e. MHA; 1 -> MQA)
    d_ff: int = 384                # F, SwiGLU hidden size (assignment 1 uses ~8/3 D)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    # --- attention variant (KV-cache lecture) ---
    attention_type: str = "gqa"    # "gqa" or "mla"
    kv_lora_rank: int | None = None   # C, MLA latent dim
    q_lora_rank: int | None = None    # MLA query compression (None = full-rank query)
    rope_head_dim: int | None = None  # MLA decoupled RoPE key dim (shared across heads)
    sliding_window: int | None = None  # local attention window (positions incl. the current one)
    global_every: int | None = None   # with sliding_window: layer i is global iff (i+1) % n == 0
    attention_sinks: int = 0          # with sliding_window: the first positions every local layer keeps (StreamingLLM)
    kv_share_group: int = 1           # CLA: adjacent layers per shared KV cache
    # --- fixed-state layers (alternatives to the transformer): a state of fixed size instead of a KV cache ---
    mixer: str = "attention"          # "linear" (BASED linear attention) or "ssd" (Mamba-2) for every layer, except
                                      # with global_every: layer i is attention iff (i+1) % global_every == 0 (Jamba 8),
                                      # windowed by sliding_window if set (BASED's small local attention)
    feature_dim: int = 16             # linear: d' dims of q and k per head (BASED); state rows 1 + d' + d'^2
    state_dim: int = 16               # ssd: dims of B and C (Mamba-2's N); state head_dim x state_dim per head
    conv_width: int = 4               # the short causal convolution in front of a fixed-state layer
    # --- output layer ---
    tie_embeddings: bool = False      # lm_head reuses token_embeddings.weight (SmolLM2, Gemma); assignment 1 unties
    # --- assignment-1 ablations (defaults: the handout's base model); each is chosen when the model is built ---
    norm_position: str = "pre"        # "pre": x + f(ln(x)); "post": ln(x + f(x)) (the original Transformer)
    norm: str = "rmsnorm"             # "rmsnorm", or "none": no ln1/ln2 (and no ln_final unless final_norm=True)
    final_norm: bool | None = None    # ln_final before lm_head; None: present iff norm == "rmsnorm"
    positional: str = "rope"          # "rope", or "none" (NoPE: the causal mask alone tells positions apart)
    ffn: str = "swiglu"               # "swiglu": w2(silu(w1 x) * w3 x); "silu": w2(silu(w1 x)), no w3
    qk_norm: str = "none"             # "gain": RMSNorm over each head of q and k (attn.q_norm/k_norm.weight, H
                                      # entries), before RoPE; "no_gain": the same without a learned gain
    ln1_eps: float | None = None      # per-norm eps; None: norm_eps
    ln2_eps: float | None = None
    ln_final_eps: float | None = None
    qk_norm_eps: float | None = None

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        for name in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads",
                     "num_kv_heads", "d_ff", "kv_share_group", "feature_dim", "state_dim", "conv_width"):
            _checks.positive_int(name, getattr(self, name))
        for name in ("kv_lora_rank", "q_lora_rank", "rope_head_dim", "sliding_window", "global_every"):
            _checks.optional_positive_int(name, getattr(self, name))
        self.rope_theta = _checks.finite_positive_float("rope_theta", self.rope_theta)
        self.norm_eps = _checks.finite_positive_float("norm_eps", self.norm_eps)
        if self.d_model % self.num_heads != 0:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim = d_model / num_heads = {self.head_dim} must be even for RoPE")
        _checks.one_of("attention_type", self.attention_type, ATTENTION_TYPES)
        _checks.one_of("mixer", self.mixer, MIXERS)
        _checks.boolean("tie_embeddings", self.tie_embeddings)
        self._check_fixed_state()
        self._check_variant()
        self._check_ablations()

    def _check_fixed_state(self) -> None:
        """Refuse fixed-state settings that do not fit together (each message names the fix)."""
        if self.mixer == "attention":
            return
        if self.attention_type != "gqa":
            raise ValueError(f"mixer={self.mixer!r} builds fixed-state layers (and GQA attention layers with "
                             f"global_every); attention_type={self.attention_type!r} does not apply, use 'gqa'")
        if self.kv_share_group != 1:
            raise ValueError(f"kv_share_group={self.kv_share_group} shares KV caches across layers, but "
                             f"mixer={self.mixer!r} layers keep a state, not keys/values; use kv_share_group=1")
        if self.global_every == 1:
            raise ValueError(f"global_every=1 makes every layer attention; use mixer='attention' instead of "
                             f"mixer={self.mixer!r}")
        if self.sliding_window is not None and self.global_every is None:
            raise ValueError(f"sliding_window applies to the attention layers that global_every places among "
                             f"mixer={self.mixer!r} layers; set global_every too (or drop sliding_window)")

    def _check_variant(self) -> None:
        """Refuse attention-variant knobs that do not fit together (each message names the fix)."""
        mla_only = [n for n in ("kv_lora_rank", "q_lora_rank", "rope_head_dim") if getattr(self, n) is not None]
        if self.attention_type == "mla":
            for name in ("kv_lora_rank", "rope_head_dim"):
                if getattr(self, name) is None:
                    raise ValueError(f"attention_type='mla' needs {name} (a positive int): MLA caches a "
                                     f"latent of kv_lora_rank dims plus a RoPE key of rope_head_dim dims")
            if self.rope_head_dim % 2 != 0:
                raise ValueError(f"rope_head_dim must be even for RoPE, got {self.rope_head_dim}")
            if self.num_kv_heads != self.num_heads:
                raise ValueError(f"attention_type='mla' has no key/value heads to group; leave num_kv_heads "
                                 f"unset (got num_kv_heads={self.num_kv_heads}, num_heads={self.num_heads})")
            if self.sliding_window is not None:
                raise ValueError("sliding_window is not supported with attention_type='mla' "
                                 "(use attention_type='gqa' for local attention)")
        elif mla_only:
            raise ValueError(f"{mla_only} only apply to attention_type='mla', got attention_type="
                             f"{self.attention_type!r}; drop them or set attention_type='mla'")
        _checks.non_negative_int("attention_sinks", self.attention_sinks)
        if self.attention_sinks and self.sliding_window is None:
            raise ValueError("attention_sinks needs sliding_window (sinks are the positions a local layer keeps "
                             "beyond its window)")
        if self.global_every is not None and self.mixer == "attention":
            if self.sliding_window is None:
                raise ValueError("global_every needs sliding_window (it says which layers stay global)")
            if self.global_every == 1:
                raise ValueError("global_every=1 makes every layer global; drop sliding_window and "
                                 "global_every for full attention")
        if self.num_layers % self.kv_share_group != 0:
            raise ValueError(f"kv_share_group ({self.kv_share_group}) must divide num_layers ({self.num_layers})")
        for first in range(0, self.num_layers, self.kv_share_group):
            group = range(first, first + self.kv_share_group)
            if len({self.layer_window(i) for i in group}) > 1:
                raise ValueError(
                    f"kv_share_group={self.kv_share_group} puts local and global layers {list(group)} in one "
                    f"sharing group (global_every={self.global_every}); layers that share a KV cache must "
                    f"all be local or all global")

    def _check_ablations(self) -> None:
        """Refuse assignment-1 ablation fields that are unknown or do not fit together (each names the fix)."""
        if self.qk_norm is None:
            self.qk_norm = "none"
        for name, allowed in (("norm_position", NORM_POSITIONS), ("norm", NORMS), ("positional", POSITIONALS),
                              ("ffn", FFNS), ("qk_norm", QK_NORMS)):
            _checks.one_of(name, getattr(self, name), allowed)
        if self.final_norm is not None:
            _checks.boolean("final_norm", self.final_norm)
        for name in NORM_EPS_FIELDS:
            if getattr(self, name) is not None:
                setattr(self, name, _checks.finite_positive_float(name, getattr(self, name)))
        if self.norm == "none" and self.norm_position != "pre":
            raise ValueError(f"norm='none' has no norms to place, so norm_position={self.norm_position!r} changes "
                             "nothing; leave norm_position='pre' (or set norm='rmsnorm' for a post-norm model)")
        unused = [n for n, built in (("ln1_eps", self.norm == "rmsnorm"), ("ln2_eps", self.norm == "rmsnorm"),
                                     ("ln_final_eps", self.has_final_norm), ("qk_norm_eps", self.qk_norm != "none"))
                  if getattr(self, n) is not None and not built]
        if unused:
            raise ValueError(f"{unused} set for norms this config does not build (norm={self.norm!r}, final_norm="
                             f"{self.final_norm!r}, qk_norm={self.qk_norm!r}); drop them or enable those norms")
        if self.attention_type == "mla" and (self.positional != "rope" or self.qk_norm != "none"):
            raise ValueError(f"positional={self.positional!r} and qk_norm={self.qk_norm!r} apply to "
                             "attention_type='gqa' only (MLA has its own decoupled RoPE key and latent norms); "
                             "use attention_type='gqa' for NoPE or QK-norm")

    @property
    def has_final_norm(self) -> bool:
        """Whether the model has ln_final (final_norm, or by default iff norm == 'rmsnorm')."""
        return self.norm == "rmsnorm" if self.final_norm is None else self.final_norm

    def eps(self, norm: str) -> float:
        """The eps of one norm ('ln1', 'ln2', 'ln_final' or 'qk_norm'): its own field, else norm_eps."""
        own = getattr(self, f"{norm}_eps")
        return self.norm_eps if own is None else own

    @property
    def is_handout_base(self) -> bool:
        """True for the handout's base block: pre-norm RMSNorm, RoPE, SwiGLU, no QK-norm, a final norm."""
        return (self.norm_position, self.norm, self.positional, self.ffn, self.qk_norm, self.has_final_norm) == \
            ("pre", "rmsnorm", "rope", "swiglu", "none", True)

    def require_handout_base(self, what: str) -> None:
        """Refuse `what` (a transform that relies on the base block's structure) for an ablation."""
        if not self.is_handout_base:
            changed = {n: getattr(self, n) for n, base in (("norm_position", "pre"), ("norm", "rmsnorm"),
                                                            ("positional", "rope"), ("ffn", "swiglu"),
                                                            ("qk_norm", "none")) if getattr(self, n) != base}
            if not self.has_final_norm and self.norm == "rmsnorm":
                changed["final_norm"] = False
            raise ValueError(f"{what} supports the handout's base block only (pre-norm RMSNorm, RoPE, SwiGLU, "
                             f"no QK-norm); this model's config has {changed}")

    def layer_mixer(self, layer: int) -> str:
        """What mixes tokens in layer `layer`: "attention", or the fixed-state `mixer` ("linear", "ssd").
        Fixed-state hybrids make layer i attention iff (i + 1) % global_every == 0."""
        if self.mixer == "attention" or (self.global_every is not None and (layer + 1) % self.global_every == 0):
            return "attention"
        return self.mixer

    def layer_window(self, layer: int) -> int | None:
        """Sliding window of layer `layer` (None = global, or not attention). Hybrids keep layer i global iff
        (i + 1) % global_every == 0, i.e. one global layer closes every block of global_every. Among
        fixed-state layers, those attention layers are the windowed ones (BASED)."""
        if self.sliding_window is None:
            return None
        if self.mixer != "attention":
            return self.sliding_window if self.layer_mixer(layer) == "attention" else None
        if self.global_every is not None and (layer + 1) % self.global_every == 0:
            return None
        return self.sliding_window

    def kv_source_layer(self, layer: int) -> int:
        """The layer whose keys/values (and cache) layer `layer` uses: the first of its CLA group."""
        return layer - layer % self.kv_share_group

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def group_size(self) -> int:
        """G = N / K query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        _checks.instance("config", data, dict, "a dict")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}; known fields: {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_name(cls, name: str, **overrides) -> "ModelConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; available presets: {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


# Presets. Real-model shapes (Llama, DeepSeek) live in `accounting`, which only counts them.
PRESETS: dict[str, dict] = {
    # Unit tests: a few thousand parameters, runs anywhere in milliseconds.
    "tiny": dict(vocab_size=257, context_length=64, d_model=32, num_layers=2, num_heads=4,
                 num_kv_heads=2, d_ff=64),
    # The shipped target (~2M parameters, trained on the offline corpus in minutes on a CPU):
    # context 512 so recall up to ~400 tokens back is measurable; GQA with G = 3.
    "target": dict(vocab_size=257, context_length=512, d_model=192, num_layers=4, num_heads=6,
                   num_kv_heads=2, d_ff=640),
    # The shipped draft (~10x fewer non-embedding parameters and FLOPs per token than the target):
    # what Minitron pruning of the target keeps (2 of 4 layers, 1 of 2 KV groups, H = 32 kept).
    "draft": dict(vocab_size=257, context_length=512, d_model=96, num_layers=2, num_heads=3,
                  num_kv_heads=1, d_ff=256),
    # ~88M parameters, 350 MB in fp32: far larger than the CPU caches, so decode is memory-bound.
    "bench-90m": dict(vocab_size=8192, context_length=1024, d_model=768, num_layers=12,
                      num_heads=12, num_kv_heads=4, d_ff=2048),
}
