"""The cache of a fixed-state layer: one recurrent state per sequence, whatever the context length.

Linear attention (Katharopoulos et al. 2020; BASED, Arora et al. 2024) and Mamba-2's state-space
layer (Dao & Gu 2024, "state space duality") are both gated linear attention, per head:

    S_t = a_t S_{t-1} + k_t v_t^T          state (F, Hv); a_t = 1 for plain linear attention
    y_t = q_t^T S_t                          (linear attention divides by q_t^T z_t, z_t = a_t z_{t-1} + k_t)

A KV cache keeps every k_t and v_t, so its bytes grow with T; this cache keeps S (and z) only:
0 bytes per token, N F Hv numbers per layer. The price is recall: everything seen is squeezed into
that one matrix (Zoology, Arora et al. 2023). Two forms give the same outputs:

- parallel (prefill, training): y = ((Q K^T) * decay) V + (decayed Q) S_0, with decay[i, j] =
  a_{j+1} ... a_i for j <= i and 0 above the diagonal: quadratic in T, like attention;
- recurrent (decode): one update of S per token (`next_state`), then y = q^T S (`read_state`): O(1) in
  the context.

Both layers also run a short causal convolution before the mixer (as Mamba-2 and Gated DeltaNet
do): its last `width - 1` inputs are a second, tiny piece of fixed state. Like every layer cache,
writes are staged until the forward commits, so a forward that raises changes nothing. A state
cannot forget the last few tokens it absorbed, so `truncate` only resets to 0 or keeps everything.
"""

from __future__ import annotations

import torch

from .kv_cache import CacheStep, LayerCache


def valid_positions(start: int, num_new: int, pad: torch.Tensor | None, device=None) -> torch.Tensor | None:
    """(B, T) True where a new token is real, False on left padding (None: no padding)."""
    if pad is None:
        return None
    positions = torch.arange(start, start + num_new, device=device)
    return positions[None, :] >= pad.to(device)[:, None]


def segment_sums(log_decay: torch.Tensor) -> torch.Tensor:
    """log_decay (..., T) -> (..., T, T): [i, j] = log a_{j+1} + ... + log a_i for j <= i, -inf above.

    Summed per segment (a masked cumsum), not as a difference of two prefix sums, which loses
    precision once the prefix sums are large (Mamba-2's `segsum`)."""
    T = log_decay.shape[-1]
    x = log_decay[..., :, None].expand(*log_decay.shape, T)                       # [i, j] = log a_i
    strictly_lower = torch.ones(T, T, dtype=torch.bool, device=log_decay.device).tril(-1)
    sums = torch.where(strictly_lower, x, 0.0).cumsum(dim=-2)                     # sum over j < k <= i
    lower = torch.ones(T, T, dtype=torch.bool, device=log_decay.device).tril()
    return torch.where(lower, sums, float("-inf"))


def parallel_form(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor | None,
                  state: torch.Tensor | None = None, normalizer: torch.Tensor | None = None,
                  normalize: bool = False) -> torch.Tensor:
    """The outputs of T tokens at once from the state S_0 before them.

    q, k (B, N, T, F); v (B, N, T, Hv); log_decay (B, N, T) or None (a_t = 1); state (B, N, F, Hv) and
    normalizer (B, N, F), or None for an empty state; normalize: divide by q^T z (linear attention)
    -> y (B, N, T, Hv)."""
    T = q.shape[2]
    scores = q @ k.transpose(-1, -2)                                               # (B, N, T, T)
    if log_decay is None:
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        weights = torch.where(causal, scores, 0.0)
        from_state = q                                                             # q_i^T S_0
    else:
        weights = scores * segment_sums(log_decay).exp()                           # 0 above the diagonal
        from_state = q * log_decay.cumsum(-1).exp()[..., None]                     # (a_1 ... a_i) q_i^T S_0
    y = weights @ v                                                                # (B, N, T, Hv)
    if state is not None:
        y = y + from_state @ state
    if not normalize:
        return y
    den = weights.sum(-1)                                                          # (B, N, T)
    if normalizer is not None:
        den = den + (from_state @ normalizer[..., None])[..., 0]
    return y / den.clamp_min(1e-6)[..., None]   # > 0 for a real token; padding rows must not be 0/0


def read_state(q: torch.Tensor, state: torch.Tensor, normalizer: torch.Tensor | None = None,
               normalize: bool = False) -> torch.Tensor:
    """The recurrent form's output for one token: y = q^T S (divided by q^T z), from the state the token
    just updated. q (B, N, 1, F), state (B, N, F, Hv) -> (B, N, 1, Hv)."""
    y = q @ state
    if normalize:
        y = y / (q @ normalizer[..., None]).clamp_min(1e-6)
    return y


def next_state(k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor | None, state: torch.Tensor,
               normalizer: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The state after T tokens: S_T = (a_1 ... a_T) S_0 + sum_j (a_{j+1} ... a_T) k_j v_j^T (and z_T)."""
    if log_decay is None:
        weighted = k
    elif k.shape[2] == 1:                                                          # decode: nothing after it
        weighted = k
        state, normalizer = _decayed(state, normalizer, log_decay[..., 0].exp())
    else:
        later = log_decay[..., 1:].flip(-1).cumsum(-1).flip(-1)                   # log a_{j+1} + ... + log a_T
        to_end = torch.cat([later, torch.zeros_like(log_decay[..., :1])], dim=-1)
        weighted = k * to_end.exp()[..., None]
        state, normalizer = _decayed(state, normalizer, log_decay.sum(-1).exp())  # a_1 ... a_T
    state = state + weighted.transpose(-1, -2) @ v                                 # (B, N, F, Hv)
    if normalizer is not None:
        normalizer = normalizer + weighted.sum(-2)
    return state, normalizer


def _decayed(state, normalizer, factor):
    """state (B, N, F, Hv) and normalizer (B, N, F) or None, each scaled by factor (B, N)."""
    return state * factor[..., None, None], None if normalizer is None else normalizer * factor[..., None]


class StateCache(LayerCache):
    """One fixed-state layer's cache: `state` (B, N, F, Hv), with linear attention's `normalizer`
    (B, N, F), and `conv`, the short convolution's last width - 1 inputs (B, width - 1, C).

    The state is kept in at least float32 (it accumulates every token it has seen). `length`
    counts the tokens folded in. `update(k, v, step, log_decay=...)` stages the state after the step
    and returns what the step's queries read; `attend` computes their outputs (recurrent for one
    token, parallel for more); `conv_window` prepends the stored inputs to the convolution's input.
    """

    def __init__(self, batch_size: int, num_heads: int, key_dim: int, value_dim: int, conv_channels: int,
                 conv_width: int, normalized: bool, kind: str, device=None, dtype: torch.dtype = torch.float32):
        state_dtype = torch.promote_types(dtype, torch.float32)
        self.state = torch.zeros(batch_size, num_heads, key_dim, value_dim, device=device, dtype=state_dtype)
        self.normalizer = (torch.zeros(batch_size, num_heads, key_dim, device=device, dtype=state_dtype)
                           if normalized else None)
        self.conv = torch.zeros(batch_size, conv_width - 1, conv_channels, device=device, dtype=dtype)
        self.kind = kind
        self.length = 0
        self._staged = None        # (step, state, normalizer, conv) written at commit

    @property
    def spec(self) -> tuple:
        """(kind, N heads, key features F, value dim Hv, conv channels, conv width): the layer's `cache_spec()`."""
        _, N, F, Hv = self.state.shape
        return (self.kind, N, F, Hv, self.conv.shape[2], self.conv.shape[1] + 1)

    @property
    def device(self) -> torch.device:
        return self.state.device

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.state, self.normalizer, self.conv) if t is not None)

    @property
    def bytes_per_token(self) -> int:
        """0: the state has the same size after one token or a million."""
        return 0

    def conv_window(self, u: torch.Tensor, step: CacheStep) -> torch.Tensor:
        """u (B, T, C), the convolution's new inputs (padding already zeroed) -> (B, width - 1 + T, C):
        the stored inputs, then u. The last width - 1 rows are staged as the next stored inputs."""
        window = torch.cat([self.conv.to(u.dtype), u], dim=1)
        self._stage(step, conv=window[:, window.shape[1] - self.conv.shape[1]:])
        return window

    def update(self, k: torch.Tensor, v: torch.Tensor, step: CacheStep,
               log_decay: torch.Tensor | None = None) -> tuple:
        """k (B, N, T, F), v (B, N, T, Hv), log_decay (B, N, T) or None: stage the state after this step;
        return (k, v, log_decay, (state, normalizer) before it, (state, normalizer) after it) for `attend`."""
        before = (self.state, self.normalizer)
        dtype = self.state.dtype
        after = next_state(k.to(dtype), v.to(dtype), None if log_decay is None else log_decay.to(dtype), *before)
        self._stage(step, state=after[0].detach(), normalizer=None if after[1] is None else after[1].detach())
        return k, v, log_decay, before, after

    def attend(self, q: torch.Tensor, kv: tuple, step: CacheStep, scale: float | None = None,
               kernel: str = "reference") -> torch.Tensor:
        """q (B, N, T, F) -> y (B, N, T, Hv): for one token the recurrent form (read the state it just
        updated), for more the parallel form from the state before them."""
        k, v, log_decay, before, after = kv
        dtype, normalize = before[0].dtype, before[1] is not None
        if q.shape[2] == 1:
            return read_state(q.to(dtype), *after, normalize=normalize).to(q.dtype)
        y = parallel_form(q.to(dtype), k.to(dtype), v.to(dtype), None if log_decay is None else log_decay.to(dtype),
                          *before, normalize=normalize)
        return y.to(q.dtype)

    def _stage(self, step: CacheStep, **writes) -> None:
        if self._staged is None or self._staged[0] is not step:
            self._staged = (step, {})
            step.staged.append(self)
        self._staged[1].update(writes)

    def commit(self, step: CacheStep) -> None:
        if self._staged is None or self._staged[0] is not step:
            raise RuntimeError("StateCache.commit: this step was not staged by update (commit follows update "
                               "within one forward)")
        writes = self._staged[1]
        self.state = writes.get("state", self.state)
        self.normalizer = writes.get("normalizer", self.normalizer)
        if "conv" in writes:
            self.conv = writes["conv"].detach().to(self.conv.dtype)
        self.length = step.end
        self._staged = None

    def check_truncate(self, n: int) -> None:
        if n not in (0, self.length):
            raise ValueError(f"cannot roll a fixed-state cache back to {n} of its {self.length} tokens: every token "
                             f"is folded into one state, which cannot give the last ones back (only "
                             f"truncate(0) or truncate({self.length}) work; speculative decoding needs a KV cache)")

    def truncate(self, n: int) -> None:
        self.check_truncate(n)
        self._staged = None
        if n == 0:
            self.state = torch.zeros_like(self.state)
            self.normalizer = None if self.normalizer is None else torch.zeros_like(self.normalizer)
            self.conv = torch.zeros_like(self.conv)
            self.length = 0
