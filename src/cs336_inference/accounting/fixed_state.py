"""What a fixed-state layer keeps: state bytes that do not grow with the context, against a KV cache.

A KV cache costs bytes per token (2 K H per attention layer); a fixed-state layer costs bytes per
layer, whatever T: "O(T) cache -> O(1) state". Hybrids mix both: Jamba (Lieber et al. 2024) puts one
attention layer among every 8 (1:7 with Mamba layers), MiniMax-01 (MiniMax 2025) one softmax
attention layer after every 7 lightning (linear) attention layers. `ModelConfig` models are counted
as `TransformerLM` builds them (`state_bytes` equals the caches' `nbytes`); `HybridShape` holds a real
hybrid's published sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import _checks
from ..model.config import ModelConfig


def state_elements(config: ModelConfig, layer: int) -> tuple[int, int]:
    """(recurrent state, convolution inputs) numbers one sequence keeps in fixed-state layer `layer`
    ((0, 0) for an attention layer): linear attention N F (H + 1) with F = 1 + d' + d'^2 (the state
    and its normaliser), SSD N state_dim H; both keep their short convolution's last width - 1 inputs."""
    _checks.instance("config", config, ModelConfig, "a ModelConfig")
    mixer = config.layer_mixer(layer)
    N, H, tail = config.num_heads, config.head_dim, config.conv_width - 1
    if mixer == "linear":
        F = 1 + config.feature_dim + config.feature_dim ** 2
        return N * F * (H + 1), tail * (2 * N * config.feature_dim + N * H)
    if mixer == "ssd":
        return N * config.state_dim * H, tail * (N * H + 2 * config.state_dim)
    return 0, 0


def state_bytes(config: ModelConfig, batch_size: int = 1, state_bytes_per_element: int = 4,
                conv_bytes_per_element: int = 4) -> int:
    """Bytes of every fixed-state layer's state for `batch_size` sequences, at any context length (the
    state is kept in float32 by default, as `StateCache` does; the convolution inputs in the model dtype)."""
    _checks.positive_int("batch_size", batch_size)
    per_sequence = 0
    for layer in range(config.num_layers):
        state, conv = state_elements(config, layer)
        per_sequence += state * state_bytes_per_element + conv * conv_bytes_per_element
    return batch_size * per_sequence


@dataclass(frozen=True)
class HybridShape:
    """A real model's attention / fixed-state mix, from its paper: one attention layer in every
    `attention_every`, the rest fixed-state layers of `state_per_layer` numbers each."""

    name: str
    num_layers: int
    attention_every: int        # 1 attention layer per this many layers
    num_kv_heads: int           # of the attention layers (GQA)
    head_dim: int
    state_per_layer: int        # numbers a fixed-state layer keeps per sequence (state + conv inputs)
    source: str

    @property
    def attention_layers(self) -> int:
        return self.num_layers // self.attention_every

    def kv_bytes_per_token(self, bytes_per_element: int = 2) -> int:
        """K and V of every attention layer: what one more token adds."""
        return 2 * self.num_kv_heads * self.head_dim * self.attention_layers * bytes_per_element

    def state_bytes(self, bytes_per_element: int = 2) -> int:
        """Every fixed-state layer's state, per sequence, at any context length."""
        return (self.num_layers - self.attention_layers) * self.state_per_layer * bytes_per_element

    def memory(self, seq_len: int, bytes_per_element: int = 2) -> dict:
        """Per sequence at `seq_len` tokens: the hybrid's KV cache and state, and the KV cache the same
        stack would need if every layer were attention."""
        _checks.positive_int("seq_len", seq_len)
        kv = self.kv_bytes_per_token(bytes_per_element) * seq_len
        all_attention = 2 * self.num_kv_heads * self.head_dim * self.num_layers * bytes_per_element * seq_len
        return {"kv_bytes": kv, "state_bytes": self.state_bytes(bytes_per_element),
                "total_bytes": kv + self.state_bytes(bytes_per_element), "all_attention_kv_bytes": all_attention}


HYBRIDS: dict[str, HybridShape] = {
    # Jamba: 32 layers (4 blocks of 8: 1 attention + 7 Mamba), GQA 8 KV heads of 128; Mamba d_inner = 2 x 4096,
    # d_state 16, d_conv 4: a state of 8192 x 16 plus 3 x 8192 conv inputs per layer.
    "jamba-52b": HybridShape("jamba-52b", num_layers=32, attention_every=8, num_kv_heads=8, head_dim=128,
                             state_per_layer=8192 * 16 + 3 * 8192,
                             source="Lieber et al. 2024, Jamba (arXiv:2403.19887), Section 2 and Table 1"),
    # MiniMax-01: 80 layers, a softmax attention layer after every 7 lightning attention layers, 64 heads of 128
    # (GQA group 8 in the softmax layers: 8 KV heads); lightning attention keeps a 128 x 128 state per head.
    "minimax-01": HybridShape("minimax-01", num_layers=80, attention_every=8, num_kv_heads=8, head_dim=128,
                              state_per_layer=64 * 128 * 128,
                              source="MiniMax 2025, MiniMax-01 (arXiv:2501.08313), Section 2"),
}
