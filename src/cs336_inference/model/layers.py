"""The building blocks of the CS336 assignment-1 Transformer: RMSNorm, SwiGLU, rotary embeddings.

RMSNorm: Zhang & Sennrich 2019. SwiGLU: Shazeer 2020. RoPE: Su et al. 2021 (RoFormer), applied to
*adjacent* pairs (x[2k], x[2k+1]) exactly as assignment 1 does, not the "rotate-half" layout.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class FusedLinear(nn.Module):
    """Several projections of the same input as one matmul: y = x [W_a; W_b; ...]^T, split back.

    Decode multiplies one row by every matrix; each call has a fixed cost (dispatch, threads), so
    q/k/v (and SwiGLU's w1/w3) as one call cost less per step. The parts keep their names: the
    parent's state dict still shows `q_proj.weight`, `k_proj.weight`, ... (see `fuse_linears`).
    """

    def __init__(self, parts: dict[str, nn.Linear]):
        super().__init__()
        first = next(iter(parts.values()))
        self.part_names = tuple(parts)
        self.splits = tuple(p.out_features for p in parts.values())
        w = first.weight
        self.proj = type(first)(first.in_features, sum(self.splits), bias=False, device=w.device, dtype=w.dtype)
        if not w.is_meta:   # a meta weight holds no values to copy (and torch traces meta ops through its compiler)
            with torch.no_grad():
                self.proj.weight.copy_(torch.cat([p.weight for p in parts.values()]))  # (sum O, I)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:  # (..., I) -> one (..., O_i) per part
        return self.proj(x).split(self.splits, dim=-1)

    def extra_repr(self) -> str:
        return ", ".join(f"{n}={o}" for n, o in zip(self.part_names, self.splits))


def fuse_linears(module: nn.Module, fused_name: str, part_names: tuple[str, ...]) -> None:
    """Replace the plain linears `part_names` of `module` (same input) by one `FusedLinear` named
    `fused_name`, in the first part's place (so module order, hence state-dict order, is kept)."""
    parts = {n: module._modules.get(n) for n in part_names}
    bad = {n: type(m).__name__ for n, m in parts.items() if not isinstance(m, nn.Linear) or m.bias is not None}
    if bad:
        raise TypeError(f"can only fuse bias-free full-precision linears, got {bad}; fuse before quantizing "
                        f"(quantize_model works on a fused model)")
    kinds = {(m.in_features, m.weight.dtype, m.weight.device) for m in parts.values()}
    if len(kinds) != 1:
        raise ValueError(f"{part_names} must share in_features, dtype and device to be fused")
    fused = FusedLinear(parts)
    fused.unfused_order = tuple(module._modules)   # children before fusing: the state-dict order
    items = list(module._modules.items())
    module._modules.clear()
    for name, child in items:
        if name == part_names[0]:
            module._modules[fused_name] = fused
        elif name not in part_names:
            module._modules[name] = child


def unfuse_linears(module: nn.Module, fused_name: str) -> None:
    """Undo `fuse_linears`: the parts come back as linears (of the fused one's class) holding their rows."""
    fused = module._modules[fused_name]
    if not isinstance(fused.proj, nn.Linear):
        raise TypeError(f"{fused_name} holds a {type(fused.proj).__name__}; only a full-precision fused "
                        f"projection can be split back")
    w = fused.proj.weight
    rows = w.detach().split(fused.splits)
    items = list(module._modules.items())
    module._modules.clear()
    for name, child in items:
        if name != fused_name:
            module._modules[name] = child
            continue
        for part, r in zip(fused.part_names, rows):
            lin = type(fused.proj)(w.shape[1], r.shape[0], bias=False, device=w.device, dtype=w.dtype)
            with torch.no_grad():
                lin.weight.copy_(r)
            module._modules[part] = lin


def _split_fused_state(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict hook: a fused projection is saved under its parts' own keys, in the order the
    unfused module would list them (its children's order before fusing)."""
    fused = {prefix + n + ".proj.weight": m for n, m in module.named_children() if isinstance(m, FusedLinear)}
    if not any(k in state_dict for k in fused):
        return
    mine = [k for k in state_dict if k.startswith(prefix)]     # this module's block of keys
    section = {}
    for key in mine:
        value = state_dict.pop(key)
        if key in fused:
            for part, piece in zip(fused[key].part_names, value.split(fused[key].splits)):
                section[prefix + part + ".weight"] = piece
        else:
            section[key] = value
    order = next(iter(fused.values())).unfused_order
    rank = {name: i for i, name in enumerate(order)}
    for key in sorted(section, key=lambda k: rank.get(k[len(prefix):].split(".")[0], -1)):
        state_dict[key] = section[key]


def _merge_fused_state(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """Load pre-hook: the parts' keys of a CS336 state dict become the fused projection's weight."""
    for name, child in module.named_children():
        if isinstance(child, FusedLinear):
            keys = [prefix + part + ".weight" for part in child.part_names]
            if all(k in state_dict for k in keys):
                state_dict[prefix + name + ".proj.weight"] = torch.cat([state_dict.pop(k) for k in keys])


def keep_unfused_state_dict_keys(module: nn.Module) -> None:
    """Make `module` save and load its fused projections under the unfused (CS336) keys."""
    module._register_state_dict_hook(_split_fused_state)
    module._register_load_state_dict_pre_hook(_merge_fused_state, with_module=True)


class RMSNorm(nn.Module):
    """y = x / rms(x) * g, computed in fp32 (as assignment 1 does) and cast back."""

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., D) -> (..., D)
        in_dtype = x.dtype
        if in_dtype != torch.float32:  # upcast only when needed: each op costs per-step overhead in decode
            x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight).to(in_dtype)


class SwiGLU(nn.Module):
    """FFN(x) = W2 (SiLU(W1 x) * W3 x); w2 is the down projection (assignment-1 names)."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False, device=device, dtype=dtype)
        self.w2 = nn.Linear(d_ff, d_model, bias=False, device=device, dtype=dtype)
        self.w3 = nn.Linear(d_model, d_ff, bias=False, device=device, dtype=dtype)
        keep_unfused_state_dict_keys(self)

    def fuse_projections(self) -> None:
        """w1 and w3 (same input) as one matmul, `w13`; the state dict keeps w1/w3."""
        if "w13" not in self._modules:
            fuse_linears(self, "w13", ("w1", "w3"))

    def unfuse_projections(self) -> None:
        if "w13" in self._modules:
            unfuse_linears(self, "w13")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., D) -> (..., D)
        gate, up = self.w13(x) if "w13" in self._modules else (self.w1(x), self.w3(x))   # (..., F) each
        return self.w2(F.silu(gate) * up)


def rope_angles(head_dim: int, max_seq_len: int, theta: float = 10000.0,
                device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape (max_seq_len, head_dim // 2): angle(i, k) = i * theta^(-2k/H)."""
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    if device is not None and torch.device(device).type == "meta":   # shapes only: torch would trace these ops
        return tuple(t.to("meta") for t in rope_angles(head_dim, max_seq_len, theta))   # through its compiler
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device=device), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of the last dim of `x` (..., T, H) by the angles in cos/sin (..., T, H/2).

    cos/sin broadcast against x's leading dims, so per-sequence positions (B, 1, T, H/2) work too.
    The pair (a, b) = (x[2k], x[2k+1]) rotated by angle t is (a cos t - b sin t, a sin t + b cos t),
    in fp32 (real ops: one formula that eager PyTorch and the compiler both run well).
    """
    a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)                                   # (..., T, H/2) each
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Precomputed RoPE tables (non-persistent buffers: they are not in the state dict)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0, device=None):
        super().__init__()
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        cos, sin = rope_angles(head_dim, max_seq_len, theta, device=device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) or (B, T) -> cos, sin of shape (T, H/2) or (B, 1, T, H/2), ready to broadcast."""
        cos, sin = self.cos[positions], self.sin[positions]
        if positions.dim() == 2:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return cos, sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.angles(positions)
        return apply_rope(x, cos, sin)
