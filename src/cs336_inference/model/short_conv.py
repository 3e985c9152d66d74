"""A short causal convolution over time, the token mixer in front of a fixed-state layer.

Mamba (Gu & Dao 2023), Mamba-2 and Gated DeltaNet convolve their projected inputs over the last few
tokens (width 4) before the recurrence, and BASED keeps short convolutions beside its linear
attention: it lets a layer bind a token to its neighbours (a key to the value right after it, in
associative recall) without spending state on it. Depthwise: each channel mixes only its own past.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class ShortConv(nn.Module):
    """y_t[c] = sum_i weight[c, i] * u_{t - width + 1 + i}[c]: causal, depthwise, no bias."""

    def __init__(self, channels: int, width: int, device=None, dtype=None):
        super().__init__()
        self.width = width
        bound = 1 / math.sqrt(width)                       # PyTorch's Conv1d default (fan_in = width)
        self.weight = nn.Parameter(torch.empty(channels, width, device=device, dtype=dtype).uniform_(-bound, bound))

    def forward(self, u: torch.Tensor, window: torch.Tensor | None = None) -> torch.Tensor:
        """u (B, T, C) -> (B, T, C). window (B, width - 1 + T, C): the inputs before u, then u (a cache's
        `conv_window`); None: zeros before the first token."""
        if window is None:
            window = F.pad(u, (0, 0, self.width - 1, 0))
        x = window.transpose(1, 2)                                                   # (B, C, width - 1 + T)
        y = F.conv1d(x, self.weight[:, None, :].to(x.dtype), groups=self.weight.shape[0])   # (B, C, T)
        return y.transpose(1, 2)

    def extra_repr(self) -> str:
        return f"channels={self.weight.shape[0]}, width={self.width}"
