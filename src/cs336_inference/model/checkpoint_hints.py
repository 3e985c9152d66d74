"""Why a student's checkpoint does not match the config, and what to pass instead: honest hints.

Each hint names the fix (a config field, a key map, allow_dropped=) and, for a suggested key map, how many
of the mismatched keys it actually fixes. Tried on the layouts and ablations seen in students' repositories:
the 2024 handout's architecture, blocks kept in a Python list, renamed modules, fused projections, the SiLU
FFN (no w3), no RMSNorm, QK-norm gains, RoPE tables and masks saved as buffers, biases.
"""

from __future__ import annotations

import re

import torch

from .checkpoint_keys import COMMON_RENAMES, rename_keys
from .config import ModelConfig

StateDict = dict[str, torch.Tensor]
_LAYER = re.compile(r"(^|\.)(\d+)\.")
_QK_NORM = re.compile(r"(^|[._])(q|k|query|key)_?(norm|ln|layernorm|rmsnorm)([._]|$)", re.IGNORECASE)
_ROPE = re.compile(r"rope|rotary|freq|(^|[._])(cos|sin)(_cached)?([._]|$)", re.IGNORECASE)
_MASK = re.compile(r"mask|tril|causal", re.IGNORECASE)
_POS_EMB = re.compile(r"(pos|position)(_|)emb|wpe")


def _per_layer(keys, suffix: str) -> list[str]:
    return [k for k in keys if re.fullmatch(rf"layers\.\d+\.{re.escape(suffix)}", k)]


def ablation_hints(state: StateDict, expected: StateDict, config: ModelConfig) -> list[str]:
    """Hints for the handout's ablations and the buffers students save, from missing/unexpected keys."""
    missing, unexpected = set(expected) - set(state), set(state) - set(expected)
    return (_ffn_hints(state, missing, unexpected, config) + _norm_hints(state, missing, unexpected, config)
            + _qk_norm_hints(state, missing, unexpected, config) + _buffer_hints(sorted(unexpected), state)
            + _layer_count_hints(state, config))


def _ffn_hints(state: StateDict, missing: set[str], unexpected: set[str], config: ModelConfig) -> list[str]:
    """The SiLU ablation (no w3 in any layer), or a gated checkpoint loaded with ffn='silu'."""
    L = config.num_layers
    two_matrices = all(len(_per_layer(state, f"ffn.{w}.weight")) == L for w in ("w1", "w2"))
    if two_matrices and len(_per_layer(missing, "ffn.w3.weight")) == L and not _per_layer(unexpected, "ffn.w3.weight"):
        return ["no layer has ffn.w3 (a feed-forward with two matrices, w2(silu(w1 x))): the handout's SiLU "
                "ablation. Load it with ModelConfig(..., ffn='silu') (its d_ff is the width of w1)"]
    if _per_layer(unexpected, "ffn.w3.weight") and config.ffn == "silu":
        return ["the checkpoint has ffn.w3 (a gated SwiGLU feed-forward) but config.ffn='silu'; use ffn='swiglu'"]
    return []


def _norm_hints(state: StateDict, missing: set[str], unexpected: set[str], config: ModelConfig) -> list[str]:
    """The no-RMSNorm ablation, a model without a final norm, or block norms loaded with norm='none'."""
    L, D = config.num_layers, config.d_model
    hints = []
    block_norms = len(_per_layer(missing, "ln1.weight")) + len(_per_layer(missing, "ln2.weight"))
    vectors = [k for k in unexpected if state[k].dim() == 1 and state[k].shape[0] == D]
    if block_norms == 2 * L and not vectors:
        final = "ln_final.weight" in missing
        hints.append("the checkpoint has no RMSNorm weights in its blocks" + (" and no final norm" if final else "")
                     + ": the handout's no-RMSNorm ablation. Load it with ModelConfig(..., norm='none'"
                     + (")" if final else ", final_norm=True) (it keeps ln_final)"))
    elif "ln_final.weight" in missing and not block_norms and not vectors:
        hints.append("the checkpoint has block norms but no final norm (ln_final): load it with "
                     "ModelConfig(..., final_norm=False)")
    if config.norm == "none" and (_per_layer(unexpected, "ln1.weight") or _per_layer(unexpected, "ln2.weight")):
        hints.append("the checkpoint has block norms (ln1/ln2) but config.norm='none'; use norm='rmsnorm'")
    return hints


def _qk_norm_hints(state: StateDict, missing: set[str], unexpected: set[str], config: ModelConfig) -> list[str]:
    """QK-norm gains in the checkpoint (per head: loadable; over the whole projection: not), or gains expected."""
    H = config.head_dim
    qk = sorted(k for k in unexpected if _QK_NORM.search(k))
    if qk:
        sizes = sorted({tuple(state[k].shape) for k in qk})
        if sizes == [(H,)]:
            return [f"{qk[:2]} look like QK-norm gains (RMSNorm over each head's H={H} entries of q and k): "
                    f"load them with ModelConfig(..., qk_norm='gain') rather than dropping them (a model "
                    f"without them computes other logits)"]
        return [f"{qk[:2]} look like QK-norm gains of shape {sizes}, but this library's qk_norm='gain' "
                f"normalises each head (H={H} entries); a norm over the whole q/k projection cannot load"]
    if config.qk_norm == "gain" and _per_layer(missing, "attn.q_norm.weight"):
        return ["config.qk_norm='gain' but the checkpoint has no q_norm/k_norm gains: use qk_norm='no_gain' "
                "(QK-norm without a learned gain) or qk_norm='none'"]
    return []


def _layer_count_hints(state: StateDict, config: ModelConfig) -> list[str]:
    L = config.num_layers
    indices = sorted({int(m.group(2)) for k in state for m in [_LAYER.search(k)] if m})
    if indices and indices[-1] >= L:
        return [f"the checkpoint has layers {indices[0]}..{indices[-1]} ({len(indices)}) but config.num_layers="
                f"{L}; set num_layers={len(indices)}"]
    return []


def _buffer_hints(unexpected: list[str], state: StateDict) -> list[str]:
    hints = []
    for what, pattern, why, suggest in (
            ("RoPE tables", _ROPE, "recomputed here from rope_theta", r"rope|rotary|freq|_cached"),
            ("attention masks", _MASK, "the causal mask is built here", r"mask|tril")):
        found = [k for k in unexpected if pattern.search(k)]
        if found:
            hints.append(f"{len(found)} key(s) look like {what} saved as buffers ({found[:2]}), {why}: pass "
                         f"allow_dropped=r{suggest!r} to discard them (a warning lists them)")
    biases = [k for k in unexpected if re.search(r"\.(bias|b)$", k)]
    if biases:
        hints.append(f"{len(biases)} key(s) are biases ({biases[:2]}, ...): the handout's model has none, so a "
                     "checkpoint with trained biases cannot load exactly; allow_dropped=r'\\.bias$' discards them "
                     "(which changes the logits: check with verify=)")
    return hints


def diagnose(state: StateDict, expected: StateDict, config: ModelConfig) -> list[str]:
    """Why `state` may not match the handout's keys, with what to pass to `load_cs336_checkpoint`."""
    unloadable = _unloadable(list(state), config)
    if unloadable:
        return [unloadable]
    hints, state = _rename_hints(state, expected, config)
    unknown = {k: v for k, v in state.items() if k not in expected}   # only keys the model does not have
    return hints + _fused_hints(unknown, config) + ablation_hints(state, expected, config)


def _unloadable(keys: list[str], config: ModelConfig) -> str | None:
    """Why no key map can load this checkpoint (the 2024 architecture, or no block weights saved), if so."""
    if any(_POS_EMB.search(k) for k in keys) and not any(k.endswith("ffn.w3.weight") for k in keys):
        return ("this looks like a 2024-format assignment-1 checkpoint: learned absolute position embeddings "
                f"({next(k for k in keys if _POS_EMB.search(k))}) and a feed-forward "
                "without w3 (GELU, two matrices). This library's model is the 2025 handout's (RoPE, SwiGLU with "
                "w1, w2, w3, no position embeddings); those weights cannot be loaded into it. Retrain with the "
                "2025 architecture")
    if not any(_LAYER.search(k) for k in keys) and config.num_layers > 0:
        return (f"the checkpoint holds no layer weights at all (keys: {sorted(keys)}): the transformer blocks "
                "were probably kept in a plain Python list (self.layers = [Block(...) ...]) instead of an "
                "nn.ModuleList, so state_dict() never saw them and the trained block weights are not in this "
                "file. Use nn.ModuleList in the model class and save the checkpoint again")
    return None


def _rename_hints(state: StateDict, expected: StateDict, config: ModelConfig) -> tuple[list[str], StateDict]:
    """A hint for key_map=COMMON_RENAMES where it fixes keys, and the state to diagnose further (renamed if so)."""
    matched = len(set(state) & set(expected))
    renamed = rename_keys(COMMON_RENAMES)(state, config)
    fixed = len(set(renamed) & set(expected)) - matched
    if fixed <= 0:
        return [], state
    left = sorted(set(expected) - set(renamed)), sorted(set(renamed) - set(expected))
    verdict = "loads this checkpoint" if not any(left) else \
        (f"fixes {fixed} of the {len(expected) - matched} missing keys; {len(left[0])} stay missing "
         f"({left[0][:3]}...) and {len(left[1])} unexpected ({left[1][:3]}...)")
    changes = [(a, b) for a, b in zip(state, renamed) if a != b]
    inner = [c for c in changes if _beyond_prefix(*c)] or changes     # show renames beyond the prefix first
    examples = ", ".join(f"{a} -> {b}" for a, b in inner[:3])
    return [f"some keys look renamed ({examples}, ...): key_map=COMMON_RENAMES {verdict}"], renamed


def _fused_hints(unknown: StateDict, config: ModelConfig) -> list[str]:
    """Fused q/k/v and gate/up projections among the keys the model does not have, by name or by shape."""
    hints = []
    qkv_rows = (config.num_heads + 2 * config.num_kv_heads) * config.head_dim
    fused_qkv = [k for k, v in unknown.items() if re.search(r"qkv|wqkv|c_attn|in_proj", k)
                 or (v.dim() == 2 and v.shape == (qkv_rows, config.d_model) and config.num_heads
                     + 2 * config.num_kv_heads > 3)]
    if fused_qkv:
        suffix = re.sub(r"^.*?\.\d+\.", "", fused_qkv[0])
        hints.append(f"{fused_qkv[0]} looks like a fused q/k/v projection ({len(fused_qkv)} such keys): key_map=[..., "
                     f"split_fused_qkv({suffix!r})] splits it (rows q, k, v; pass order= if yours differ)")
    fused_ffn = [k for k, v in unknown.items() if re.search(r"gate_up|w13|w1w3|fc_in", k)
                 or (v.dim() == 2 and v.shape == (2 * config.d_ff, config.d_model))]
    if fused_ffn:
        suffix = re.sub(r"^.*?\.\d+\.", "", fused_ffn[0])
        hints.append(f"{fused_ffn[0]} looks like a fused gate/up projection ({len(fused_ffn)} such keys): key_map="
                     f"[..., split_fused_gate_up({suffix!r})] splits it into ffn.w1 (SiLU gate) and ffn.w3")
    return hints


def _beyond_prefix(before: str, after: str) -> bool:
    """True when a rename changes more than the key's first component (not a prefix-only rename)."""
    return before.split(".", 1)[-1] != after.split(".", 1)[-1]
