"""Loading a student's assignment-1 checkpoint whose keys differ from the handout's: key maps and diagnoses.

Tried on public CS336 assignment-1 repositories, most checkpoints that do not load follow a few
patterns: renamed modules (`token_embedding`, `attention.out_proj`, `feed_forward.gate_proj`,
`final_norm.gain`, ...), one fused q/k/v projection, one fused gate/up projection, the 2024 handout's
architecture (learned position embeddings, a feed-forward without w3), or blocks kept in a plain Python
list (so `state_dict()` never saw them). `load_cs336_checkpoint(..., key_map=...)` maps the keys first:

    key_map = {r"regex": "replacement", ...}            rename keys (re.sub, in order)
    key_map = fn(state_dict, config) -> state_dict      any transformation
    key_map = [one of the above, ...]                   applied in order

Helpers: `rename_keys` (a dict or a key -> key function), `COMMON_RENAMES` (the names seen in practice),
`split_fused_qkv`, `split_fused_gate_up`; `key_map="auto"` infers the mapping (`key_inference`). When a
checkpoint still does not match, `checkpoint_hints.diagnose` says which of these cases it looks like and what
to pass.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from .config import ModelConfig

StateDict = dict[str, torch.Tensor]

# Names seen in students' assignment-1 models -> the handout's (applied with re.sub, in this order).
COMMON_RENAMES: dict[str, str] = {
    r"^(tok_embeddings|token_embedding|token_emb|embedding|embeddings|wte)\.": "token_embeddings.",
    r"^(blocks|transformer_blocks|h|transformer\.h|transformer\.layers|decoder\.layers)\.": "layers.",
    r"\.(attention|self_attn|self_attention|mha|attn_layer)\.": ".attn.",
    r"\.attn\.(out_proj|o_proj|wo|W_o|proj|c_proj)\.": ".attn.output_proj.",
    r"\.attn\.(wq|W_q|query)\.": ".attn.q_proj.",
    r"\.attn\.(wk|W_k|key)\.": ".attn.k_proj.",
    r"\.attn\.(wv|W_v|value)\.": ".attn.v_proj.",
    r"\.(feed_forward|ff|mlp|ffn_layer|swiglu)\.": ".ffn.",
    r"\.ffn\.(gate_proj|W1|w_gate)\.": ".ffn.w1.",
    r"\.ffn\.(down_proj|W2|w_down)\.": ".ffn.w2.",
    r"\.ffn\.(up_proj|W3|w_up)\.": ".ffn.w3.",
    r"\.(attn_norm|attention_norm|norm1|ln_1|input_layernorm|rms_norm1|norm_attn)\.": ".ln1.",
    r"\.(ffn_norm|mlp_norm|norm2|ln_2|post_attention_layernorm|rms_norm2|norm_ffn)\.": ".ln2.",
    r"^(final_norm|norm_final|ln_f|norm|final_layernorm|rms_norm_final)\.": "ln_final.",
    r"^(output|head|out_proj|lm_head_proj|unembedding|output_proj)\.": "lm_head.",
    r"\.(gain|g|scale)$": ".weight",
}


def rename_keys(mapping: dict[str, str | None] | Callable[[str], str | None]) -> Callable[[StateDict, ModelConfig],
                                                                                     StateDict]:
    """A key map renaming every key: regex patterns -> replacements (re.sub, in order; a None replacement
    drops the keys the pattern matches) or a function key -> new key (None drops the tensor). Dropping needs
    the loader's allow_dropped=, which warns which tensors were discarded."""
    if callable(mapping):
        def rename(key: str) -> str | None:
            new = mapping(key)
            if new is not None and not isinstance(new, str):
                raise TypeError(f"a key_map function must return a str (or None to drop), got "
                                f"{type(new).__name__} for {key!r}")
            return new
    elif isinstance(mapping, dict):
        compiled = [(_compile(pattern), _replacement(pattern, replacement)) for pattern, replacement in mapping.items()]

        def rename(key: str) -> str | None:
            for pattern, replacement in compiled:
                if replacement is None:
                    if pattern.search(key):
                        return None
                    continue
                try:
                    key = pattern.sub(replacement, key)
                except (re.error, IndexError) as e:
                    raise ValueError(f"key_map replacement {replacement!r} for pattern {pattern.pattern!r} fails "
                                     f"on key {key!r}: {e}") from None
            return key
    else:
        raise TypeError(f"rename_keys takes a dict of regex patterns or a function key -> key, "
                        f"got {type(mapping).__name__}")

    def apply(state: StateDict, config: ModelConfig) -> StateDict:
        out: StateDict = {}
        for key, value in state.items():
            new = rename(key)
            if new is None:
                continue
            if new in out:
                raise ValueError(f"key_map maps two keys to {new!r} (one of them is {key!r})")
            out[new] = value
        return out
    return apply


def _compile(pattern) -> re.Pattern:
    if isinstance(pattern, re.Pattern):
        return pattern
    if not isinstance(pattern, str):
        raise TypeError(f"key_map patterns must be regex strings, got {pattern!r} ({type(pattern).__name__})")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"key_map pattern {pattern!r} is not a valid regular expression: {e}") from None


def _replacement(pattern, replacement) -> str | None:
    if replacement is not None and not isinstance(replacement, str):
        raise TypeError(f"key_map replacement for {pattern!r} must be a str (or None to drop the keys it "
                        f"matches), got {replacement!r} ({type(replacement).__name__})")
    return replacement


def _split(state: StateDict, suffix: str, parts: list[tuple[str, int]], what: str) -> StateDict:
    """Replace every key ending in `suffix` by row blocks named parts[i][0] of parts[i][1] rows."""
    out: StateDict = {}
    for key, value in state.items():
        if not key.endswith(suffix):
            out[key] = value
            continue
        rows = sum(n for _, n in parts)
        if value.shape[0] != rows:
            raise ValueError(f"{key} has {value.shape[0]} rows; a fused {what} for this config has {rows} "
                             f"({' + '.join(f'{name} {n}' for name, n in parts)})")
        prefix = key[: len(key) - len(suffix)]
        for (name, _), block in zip(parts, value.split([n for _, n in parts], dim=0)):
            out[f"{prefix}{name}.weight"] = block   # a view: the loader copies it
    return out


def split_fused_qkv(suffix: str = "attn.qkv_proj.weight", order: str = "qkv") -> Callable:
    """A key map splitting a fused projection (rows: q (N H), k (K H), v (K H), in `order`) into the
    handout's attn.q_proj / k_proj / v_proj. `suffix`: the fused weight's key after `layers.{i}.`."""
    if sorted(order) != ["k", "q", "v"]:
        raise ValueError(f"order must be a permutation of 'qkv', got {order!r}")

    def apply(state: StateDict, config: ModelConfig) -> StateDict:
        H = config.head_dim
        rows = {"q": config.num_heads * H, "k": config.num_kv_heads * H, "v": config.num_kv_heads * H}
        return _split(state, suffix, [(f"attn.{c}_proj", rows[c]) for c in order], "q/k/v projection")
    return apply


def split_fused_gate_up(suffix: str = "ffn.gate_up_proj.weight", order: str = "gate_up") -> Callable:
    """A key map splitting a fused SwiGLU input projection (2F rows: the SiLU gate (w1) and the linear
    "up" branch (w3), in `order`) into the handout's ffn.w1 and ffn.w3."""
    names = {"gate_up": ["ffn.w1", "ffn.w3"], "up_gate": ["ffn.w3", "ffn.w1"]}
    if order not in names:
        raise ValueError(f"order must be 'gate_up' or 'up_gate', got {order!r}")

    def apply(state: StateDict, config: ModelConfig) -> StateDict:
        return _split(state, suffix, [(name, config.d_ff) for name in names[order]], "gate/up projection")
    return apply


def apply_key_map(state: StateDict, key_map, config: ModelConfig, dropped: list[str] | None = None) -> StateDict:
    """`state` with `key_map` applied (see the module docstring); None returns it unchanged.

    dropped: if given, receives the keys of tensors a step discarded (a step that returns fewer elements
    than it was given dropped something; the keys named are those whose storage no output still uses)."""
    if key_map is None:
        return state
    steps = key_map if isinstance(key_map, (list, tuple)) else [key_map]
    for step in steps:
        if isinstance(step, dict):
            step = rename_keys(step)
        if not callable(step):
            raise TypeError(f"key_map must be a dict of regex renames, a callable (state_dict, config) -> "
                            f"state_dict, 'auto', or a list of them; got {type(step).__name__}")
        before = state
        state = step(dict(state), config)
        if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                  for k, v in state.items()):
            raise TypeError(f"a key_map callable must return a dict of str -> tensor, got {type(state).__name__}"
                            + ("" if not isinstance(state, dict) else " with other keys or values"))
        if dropped is not None and _numel(state) < _numel(before):
            kept = {_storage(v) for v in state.values()}
            dropped += [k for k, v in before.items() if _storage(v) not in kept]
    return state


def _numel(state: StateDict) -> int:
    return sum(v.numel() for v in state.values())


def _storage(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.device) if t.device.type != "meta" else (id(t),)
