"""An EAGLE draft: one decoder layer that extrapolates the target's features (Li et al. 2024, arXiv:2401.15077).

The target's feature at position t is h_t = norm(f_t): its last block's output f_t after the final
norm, the LM head's input, so lm_head(h_t) predicts token t+1. (EAGLE's released code reads this tensor
too: the base model's last hidden state, after its final norm, and sends the draft's output straight to
the LM head. It is the better-conditioned input: SmolLM2's raw f_t has a few values far larger than the
rest, the first token's above all, which the norm divides out.) EAGLE predicts the *next feature*:

    g_t = fc(concat(h_t, embed(x_{t+1})))        (2D -> D; x_{t+1} is the token h_t predicted)
    h^_{t+1} = Block(g_<=t)                      (one decoder layer of the target's shape, causal, own KV cache)
    token t+2 ~ lm_head(h^_{t+1})                (the target's frozen LM head)

Feeding the token sampled at each step back in (x_{t+1}) is what Medusa's independent heads lack:
the draft knows which branch it is on, so its acceptance decays slowly with depth. While drafting,
the draft runs on its own guesses h^; once the target has verified a pass, the draft's cache is
rolled back with the target's to the positions it computed from true features (`rollback`), and the
newly final positions are fed with the target's features at the next `propose`.

Sampling from the draft's distributions and passing them to the accept/resample rule keeps the output
exact, as with any draft model.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .. import _checks
from ..model.attention import attention_mask
from ..model.config import ModelConfig
from ..model.kv_cache import KVCache
from ..model.layers import RotaryEmbedding
from ..model.transformer import TransformerBlock, TransformerLM
from .draft_vocab import DraftHead, draft_head
from .drafters import draw_draft
from .medusa import check_heads_match
from .sampling_params import SamplingParams


def eagle_config(target: ModelConfig) -> ModelConfig:
    """The draft's one layer: the target's attention shape and RoPE (it reads the target's features),
    a feed-forward half as wide (the draft ships as a package asset: a few MB)."""
    _checks.instance("target", target, ModelConfig)
    return target.replace(num_layers=1, d_ff=max(1, target.d_ff // 2))


class EagleDraft(nn.Module):
    """fc + one `TransformerBlock`: (features (B, T, D), next-token embeddings (B, T, D)) -> next features (B, T, D)."""

    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        _checks.instance("config", config, ModelConfig)
        if config.num_layers != 1:
            raise ValueError(f"an EAGLE draft is one decoder layer: config.num_layers must be 1, got "
                             f"{config.num_layers} (build it with eagle_config(target.config))")
        self.config, self.d_model = config, config.d_model
        self.vocab = None       # the token ids the draft was trained to rank (`draft_vocab`); None: all
        self.fc = nn.Linear(2 * config.d_model, config.d_model, bias=True, device=device, dtype=dtype)
        self.block = TransformerBlock(config, 0, device=device, dtype=dtype)
        self.rope = RotaryEmbedding(config.head_dim, config.context_length, config.rope_theta, device=device)

    def new_cache(self, max_seq_len: int, max_rollback: int = 1) -> KVCache:
        """The draft's own cache (one sequence)."""
        device, dtype = self.fc.weight.device, self.fc.weight.dtype
        return KVCache([self.block.attn.new_cache(1, max_seq_len, device=device, dtype=dtype,
                                                  max_rollback=max_rollback)], max_seq_len, 1)

    def forward(self, features: torch.Tensor, next_embeddings: torch.Tensor, cache: KVCache | None = None,
                positions: torch.Tensor | None = None, visible: torch.Tensor | None = None) -> torch.Tensor:
        """features h_t (after the target's final norm), next_embeddings embed(x_{t+1}) (B, T, D) -> predicted
        h_{t+1} (B, T, D).

        Without a cache the T positions are 0..T-1 under a causal mask (training); with one they are
        appended at cache.length and the cache advances by T. A draft tree (`eagle_tree`) overrides both
        with a cache: positions (T,) the RoPE positions, visible (T, cache.length + T) bool the cache
        slots each new position attends to (the true context, its ancestors, itself)."""
        x = self.fc(torch.cat([features, next_embeddings], dim=-1))                   # (B, T, D)
        T = x.shape[1]
        if cache is None:
            if positions is not None or visible is not None:
                raise ValueError("positions and visible override a cache's positions and mask: pass cache= too")
            positions = torch.arange(T, device=x.device)
            mask, layer, step = attention_mask(T, T, 0, device=x.device), None, None
        else:
            step = cache.begin(T)
            if (positions is None) != (visible is None):
                raise ValueError("positions and visible go together (a draft tree sets both), got one of them")
            if visible is not None:
                if tuple(positions.shape) != (T,) or tuple(visible.shape) != (T, step.end):
                    raise ValueError(f"positions must be ({T},) and visible ({T}, {step.end}) for {T} new "
                                     f"positions after {step.start} cached, got {tuple(positions.shape)} and "
                                     f"{tuple(visible.shape)}")
                step.positions, step.mask = positions.to(x.device), visible.to(x.device)[None, None]
            positions, mask, layer = step.positions, None, step.layers[0]
        out, _ = self.block(x, self.rope.angles(positions), mask, layer, step)
        if step is not None:
            step.commit()
        return out


class EagleDrafter:
    """The `Drafter` protocol for an EAGLE draft on a target it shares the embedding, final norm and LM head with.

    Invariant: draft cache position t holds (h_t, x_{t+1}); the first `true_len` were computed from the
    target's features, the rest (the last pass's drafting) from the draft's own guesses. Its logits go
    through the target's LM head restricted to the draft's vocabulary (`draft_vocab.DraftHead`).
    """

    def __init__(self, target: TransformerLM, draft: EagleDraft, head: DraftHead | None = None):
        _checks.instance("draft", draft, EagleDraft)
        check_heads_match(target, draft.d_model, "the EAGLE draft")
        self.target, self.draft, self.head = target, draft, draft_head(target, draft, head)
        self.cache, self.true_len, self.pending, self.forwards = None, 0, [], 0

    def start(self, prompt: list[int], max_seq_len: int, max_rollback: int = 1) -> None:
        self.cache = self.draft.new_cache(max_seq_len, max_rollback)
        self.true_len, self.pending, self.forwards = 0, [], 0

    def observe(self, features: torch.Tensor) -> None:
        """features (T, D): the target's last-block outputs f of T more final positions (what the loops hand
        every feature drafter); kept as h = norm(f), the draft's input, and fed at the next `propose`."""
        self.pending.append(self.target.ln_final(features))

    def _step(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """features (T, D), tokens (T,) -> the draft's next feature after the last, (D,)."""
        emb = self.target.token_embeddings(tokens)                                   # (T, D)
        return self.draft(features[None], emb[None], self.cache)[0, -1]

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        """The draft's predicted feature(s) h^ (..., D) -> next-token logits (..., V), through the target's head
        (-inf outside the draft's vocabulary)."""
        return self.head(feature)

    def read_pending(self, sequence: list[int]) -> torch.Tensor:
        """Feed the target's features that arrived through `observe` -> the draft's feature after the last
        of them (D,): its guess of the feature at position len(sequence) - 1 (the next token's logits)."""
        new = torch.cat(self.pending) if len(self.pending) > 1 else self.pending[0]  # (m, D)
        m = new.shape[0]
        tokens = torch.tensor(sequence[self.true_len + 1:self.true_len + 1 + m], device=new.device)   # x_{t+1}
        feature = self._step(new.to(self.draft.fc.weight.dtype), tokens)
        self.true_len, self.pending = self.true_len + m, []
        return feature

    def propose(self, sequence: list[int], n: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None]:
        if n == 0:
            return [], None
        feature = self.read_pending(sequence)
        drafts, probs = [], []
        for i in range(n):
            logits = self.logits(feature)
            self.forwards += 1
            token, p = draw_draft(logits, sampling, generator)
            if p is not None:
                probs.append(p)
            drafts.append(token)
            if i + 1 < n:
                feature = self._step(feature[None], token.reshape(1))
        return torch.stack(drafts).tolist(), (torch.stack(probs) if probs else None)

    def rollback(self, length: int) -> None:
        """Forget the positions computed from the draft's own guesses: what stays was computed from the
        target's features of final positions (true_len <= length - 1). The newly final ones arrive
        through `observe` and are fed at the next `propose`."""
        if self.cache.length > self.true_len:
            self.cache.truncate(self.true_len)
