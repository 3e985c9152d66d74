"""Medusa heads: K extra decoding heads on the target's last hidden state (Cai et al. 2024, arXiv:2401.10774).

The target's LM head reads the final (normed) hidden state h_t and predicts token t+1. Medusa adds K
small heads on the same h_t: head k is a residual block z_k = h_t + SiLU(W_k h_t) whose output goes
through the *frozen* LM head and predicts token t+1+k, skipping the tokens in between. Only the
W_k (D x D each) train; W_k starts at zero, so an untrained head repeats the target's own guess.

The heads never see the tokens they skip, so their guesses are independent of each other: head 2
cannot know what head 1 proposed. That is why their acceptance falls quickly with k, and what EAGLE
(`eagle`) fixes by feeding its own guesses back.

`MedusaDrafter` is the chain form (top-1 of each head, or one sample from each head's distribution)
and plugs into the speculative loop as a `Drafter`: the loop hands it the target's features of every
position that becomes final (`observe`), and it reads the last one. Drawing x_k from head k's
distribution p_k and passing p_k to the accept/resample rule keeps the output exact: the rule needs a
proposal distribution per position given the accepted prefix, and p_k is one (a poor one, as it ignores
x_1..x_{k-1}). `medusa_tree` verifies a tree of candidates instead.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import _checks
from ..model.transformer import TransformerLM
from .draft_vocab import DraftHead, draft_head
from .drafters import draw_draft
from .sampling_params import SamplingParams


class MedusaHeads(nn.Module):
    """K residual heads: h (..., D) (normed last hidden state) -> (..., K, D), the inputs of the LM head."""

    def __init__(self, d_model: int, num_heads: int, device=None, dtype=None):
        super().__init__()
        _checks.positive_int("num_heads", num_heads)
        _checks.positive_int("d_model", d_model)
        self.d_model, self.num_heads = d_model, num_heads
        self.vocab = None       # the token ids the heads were trained to rank (`draft_vocab`); None: all
        self.proj = nn.ModuleList(nn.Linear(d_model, d_model, bias=False, device=device, dtype=dtype)
                                  for _ in range(num_heads))
        for w in self.proj:   # zero: an untrained head is the identity (it guesses what the LM head does)
            nn.init.zeros_(w.weight)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h (..., D) -> (..., K, D): z_k = h + SiLU(W_k h)."""
        return torch.stack([h + F.silu(w(h)) for w in self.proj], dim=-2)


def check_heads_match(target: TransformerLM, d_model: int, what: str) -> None:
    """A draft built for another hidden size cannot read this target's features."""
    _checks.instance("target", target, TransformerLM)
    if d_model != target.config.d_model:
        raise ValueError(f"{what} has hidden size d_model={d_model} but the target's is {target.config.d_model}; "
                         "heads are trained for one target (load the ones made for it)")


class MedusaDrafter:
    """The `Drafter` protocol for Medusa heads, chain form: up to K tokens per pass, one per head.

    observe(features (T, D)): the target's pre-norm hidden states of the positions that became final
    (the loop calls it after the prefill and after each pass); propose reads the last one. The heads'
    logits go through the target's LM head restricted to their vocabulary (`draft_vocab.DraftHead`).
    """

    def __init__(self, target: TransformerLM, heads: MedusaHeads, head: DraftHead | None = None):
        _checks.instance("heads", heads, MedusaHeads)
        check_heads_match(target, heads.d_model, "the Medusa heads")
        self.target, self.heads, self.head = target, heads, draft_head(target, heads, head)
        self.last = None        # (D,) pre-norm feature of the last final position
        self.forwards = 0       # head evaluations (one per pass)

    @property
    def num_heads(self) -> int:
        return self.heads.num_heads

    def start(self, prompt: list[int], max_seq_len: int, max_rollback: int = 1) -> None:
        self.last, self.forwards = None, 0

    def observe(self, features: torch.Tensor) -> None:
        """features (T, D): the target's features of T more final positions."""
        self.last = features[-1]

    def head_logits(self, n: int) -> torch.Tensor:
        """(n, V): heads 1..n's logits for the tokens 2..n+1 positions after the last final one."""
        z = self.heads(self.target.ln_final(self.last))[:n]                          # (n, D)
        return self.head(z)

    def propose(self, sequence: list[int], n: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None]:
        n = min(n, self.num_heads)
        if n == 0:
            return [], None
        logits = self.head_logits(n)                                                  # (n, V)
        self.forwards += 1
        tokens, probs = draw_draft(logits, sampling, generator)                      # one token per head
        return tokens.tolist(), probs

    def rollback(self, length: int) -> None:
        """Nothing cached: the features of the final positions arrive through `observe`."""
