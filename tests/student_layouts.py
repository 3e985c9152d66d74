"""Small assignment-1 models written the way students name things, for the checkpoint-loading tests.

Written here from the handout's math (not from the library, not from anyone's repository): one configurable
model whose module and parameter names follow a `Layout` (so its state_dict() has that layout's keys) and
whose forward is a naive implementation of the configured architecture (so it is the reference logits of
that layout). Parameters can sit in a Linear-like module under `.weight`/`.w`/`.W`/`.weights`, or directly
on the attention / FFN module (`attn.Wq`); q/k/v and gate/up can be fused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn


@dataclass
class Layout:
    embedding: str = "token_embeddings.weight"
    layers: str = "layers"
    index: str = "{i}"                      # "layer_{i}": blocks in an nn.ModuleDict
    attn: str = "attn"                      # the attention module's name inside a block
    q: str = "q_proj.weight"                # names inside the attention module ("Wq": a bare parameter)
    k: str = "k_proj.weight"
    v: str = "v_proj.weight"
    o: str = "output_proj.weight"
    qkv: str | None = None                  # a fused (q; k; v) projection instead of q, k, v
    q_norm: str = "q_norm.weight"
    k_norm: str = "k_norm.weight"
    ffn: str = "ffn"
    w1: str = "w1.weight"                   # gate
    w2: str = "w2.weight"                   # down
    w3: str = "w3.weight"                   # up
    gate_up: str | None = None              # a fused (gate; up) projection instead of w1, w3
    ln1: str = "ln1.weight"
    ln2: str = "ln2.weight"
    ln_final: str = "ln_final.weight"
    head: str = "lm_head.weight"
    buffers: dict = field(default_factory=dict)   # persistent buffers some students save: name -> shape


@dataclass
class Arch:
    """The architecture, in the handout's words (independent of the library's ModelConfig)."""
    vocab: int = 97
    d_model: int = 32
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    d_ff: int = 48
    theta: float = 10000.0
    eps: float = 1e-5
    post_norm: bool = False
    rope: bool = True
    swiglu: bool = True
    norms: bool = True
    qk_norm: str = "none"        # "none", "gain", "no_gain"
    qk_eps: float = 1e-6


class Holder(nn.Module):
    """A module reached by a dotted path: parameters are registered along the path."""


def _put(root: nn.Module, path: str, value: torch.Tensor) -> None:
    *mods, leaf = path.split(".")
    for m in mods:
        if not hasattr(root, m):
            root.add_module(m, Holder())
        root = getattr(root, m)
    root.register_parameter(leaf, nn.Parameter(value))


def _get(root: nn.Module, path: str) -> torch.Tensor:
    for part in path.split("."):
        root = getattr(root, part)
    return root


class StudentLM(nn.Module):
    def __init__(self, arch: Arch, layout: Layout, seed: int = 0):
        super().__init__()
        self.arch, self.layout = arch, layout
        g = torch.Generator().manual_seed(seed)
        a, D, F = arch, arch.d_model, arch.d_ff
        H = D // a.heads
        rand = lambda *shape: torch.randn(*shape, generator=g) / math.sqrt(shape[-1])  # noqa: E731
        gains = lambda n: 1 + 0.3 * torch.randn(n, generator=g)  # noqa: E731
        _put(self, layout.embedding, torch.randn(a.vocab, D, generator=g))
        for i in range(a.layers):
            at = f"{layout.layers}.{layout.index.format(i=i)}.{layout.attn}."
            ff = f"{layout.layers}.{layout.index.format(i=i)}.{layout.ffn}."
            q, k, v = rand(a.heads * H, D), rand(a.kv_heads * H, D), rand(a.kv_heads * H, D)
            if layout.qkv:
                _put(self, at + layout.qkv, torch.cat([q, k, v]))
            else:
                for name, w in ((layout.q, q), (layout.k, k), (layout.v, v)):
                    _put(self, at + name, w)
            _put(self, at + layout.o, rand(D, a.heads * H))
            if a.qk_norm == "gain":
                _put(self, at + layout.q_norm, gains(H))
                _put(self, at + layout.k_norm, gains(H))
            if a.swiglu and layout.gate_up:
                _put(self, ff + layout.gate_up, torch.cat([rand(F, D), rand(F, D)]))
            else:
                _put(self, ff + layout.w1, rand(F, D))
                if a.swiglu:
                    _put(self, ff + layout.w3, rand(F, D))
            _put(self, ff + layout.w2, rand(D, F))
            if a.norms:
                _put(self, f"{layout.layers}.{layout.index.format(i=i)}.{layout.ln1}", gains(D))
                _put(self, f"{layout.layers}.{layout.index.format(i=i)}.{layout.ln2}", gains(D))
            for name, shape in layout.buffers.items():
                holder = _get(self, f"{layout.layers}.{layout.index.format(i=i)}.{layout.attn}")
                holder.register_buffer(name, torch.randn(*shape, generator=g))
        if a.norms:
            _put(self, layout.ln_final, gains(D))
        _put(self, layout.head, rand(a.vocab, D))

    # --- the naive forward of this architecture ---
    def _norm(self, x, gain, eps):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * gain

    def _rope(self, x):   # x (B, heads, T, H): rotate (x[2j], x[2j+1]) by t * theta^(-2j/H)
        T, H = x.shape[-2], x.shape[-1]
        j = torch.arange(H // 2, dtype=torch.float64)
        angle = torch.arange(T, dtype=torch.float64)[:, None] * self.arch.theta ** (-2 * j / H)
        cos, sin = angle.cos().float(), angle.sin().float()
        even, odd = x[..., 0::2], x[..., 1::2]
        out = torch.empty_like(x)
        out[..., 0::2] = even * cos - odd * sin
        out[..., 1::2] = even * sin + odd * cos
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        a, lay = self.arch, self.layout
        D = a.d_model
        H, G = D // a.heads, a.heads // a.kv_heads
        B, T = ids.shape
        x = _get(self, lay.embedding)[ids]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        for i in range(a.layers):
            block = f"{lay.layers}.{lay.index.format(i=i)}."
            at, ff = f"{block}{lay.attn}.", f"{block}{lay.ffn}."

            def norm(y, name, block=block):
                return self._norm(y, _get(self, block + name), a.eps) if a.norms else y
            h = x if a.post_norm else norm(x, lay.ln1)
            if lay.qkv:
                q, k, v = (h @ _get(self, at + lay.qkv).T).split([a.heads * H, a.kv_heads * H, a.kv_heads * H], -1)
            else:
                q, k, v = (h @ _get(self, at + n).T for n in (lay.q, lay.k, lay.v))
            q = q.view(B, T, a.heads, H).transpose(1, 2)
            k = k.view(B, T, a.kv_heads, H).transpose(1, 2).repeat_interleave(G, dim=1)
            v = v.view(B, T, a.kv_heads, H).transpose(1, 2).repeat_interleave(G, dim=1)
            if a.qk_norm != "none":
                one = torch.ones(H)
                q = self._norm(q, _get(self, at + lay.q_norm) if a.qk_norm == "gain" else one, a.qk_eps)
                k = self._norm(k, _get(self, at + lay.k_norm) if a.qk_norm == "gain" else one, a.qk_eps)
            if a.rope:
                q, k = self._rope(q), self._rope(k)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(H)
            att = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v
            x = x + att.transpose(1, 2).reshape(B, T, D) @ _get(self, at + lay.o).T
            if a.post_norm:
                x = norm(x, lay.ln1)
            h = x if a.post_norm else norm(x, lay.ln2)
            if a.swiglu and lay.gate_up:
                gate, up = (h @ _get(self, ff + lay.gate_up).T).chunk(2, -1)
            else:
                gate = h @ _get(self, ff + lay.w1).T
                up = h @ _get(self, ff + lay.w3).T if a.swiglu else 1.0
            x = x + (gate * torch.sigmoid(gate) * up) @ _get(self, ff + lay.w2).T
            if a.post_norm:
                x = norm(x, lay.ln2)
        if a.norms:
            x = self._norm(x, _get(self, lay.ln_final), a.eps)
        return x @ _get(self, lay.head).T


# The layouts seen in students' repositories (names only; every model here is written in this file).
LAYOUTS = {
    "handout": Layout(),
    "embed_matrix_blocks_norm12_out_proj_W123": Layout(
        embedding="embed.embed_matrix", layers="blocks", o="out_proj.weight", ln1="norm1.weight",
        ln2="norm2.weight", w1="W1", w2="W2", w3="W3", ln_final="final_norm.weight", head="lm_head.weight"),
    "bare_Wq_Wk_Wv_Wo_dot_w": Layout(
        embedding="tok_emb.w", layers="transformer_layers", q="Wq", k="Wk", v="Wv", o="Wo", ffn="ffn",
        w1="w1.w", w2="w2.w", w3="w3.w", ln1="ln1.w", ln2="ln2.w", ln_final="ln_final.w", head="lm_head.w"),
    "mha_r_w_Q_swiglu_ff_linear_W_g": Layout(
        embedding="embedding.embedding", attn="mha_r", q="w_Q.W", k="w_K.W", v="w_V.W", o="w_O.W",
        ffn="swiglu_ff", w1="linear_1.W", w2="linear_2.W", w3="linear_3.W", ln1="rms_norm1.g",
        ln2="rms_norm2.g", ln_final="out_norm.g", head="out_linear.W"),
    "gain_weights_ffn_l1_output_embed": Layout(
        embedding="embeddings.weights", layers="blocks", attn="attention", q="query.weights", k="key.weights",
        v="value.weights", o="out.weights", ffn="ffn", w1="l1.w", w2="l2.w", w3="l3.w",
        ln1="attn_norm.gain", ln2="ffn_norm.gain", ln_final="final_norm.gain", head="output_embed.w"),
    "fused_qkv_proj_weights": Layout(
        layers="blocks", qkv="qkv_proj.weights", o="out_proj.weights", ln1="norm1.gain", ln2="norm2.gain",
        ln_final="out_norm.gain", head="out_linear.weights"),
    "fused_gate_up_llama_names": Layout(
        embedding="tok_embeddings.weight", attn="self_attn", q="q_proj.weight", k="k_proj.weight",
        v="v_proj.weight", o="o_proj.weight", ffn="mlp", gate_up="gate_up_proj.weight", w2="down_proj.weight",
        ln1="input_layernorm.weight", ln2="post_attention_layernorm.weight", ln_final="norm.weight",
        head="output.weight"),
    "moduledict_layer_i_wq_feed_forward": Layout(
        layers="layers", index="layer_{i}", q="wq", k="wk", v="wv", o="wo", ffn="feed_forward", w1="w1", w2="w2",
        w3="w3", ln1="attention_norm.weight", ln2="ffn_norm.weight", ln_final="norm.weight", head="output.weight"),
    "norms_inside_sublayers_Wqkv_names": Layout(
        embedding="wte.weight", layers="h", attn="attn", q="W_q.weight", k="W_k.weight", v="W_v.weight",
        o="W_o.weight", ffn="mlp", w1="gate.weight", w2="down.weight", w3="up.weight", ln1="attn.norm.scale",
        ln2="mlp.norm.scale", ln_final="ln_f.scale", head="head.weight"),
}
