"""The building blocks of the CS336 assignment-1 Transformer: RMSNorm, SwiGLU, rotary embeddings.

RMSNorm: Zhang & Sennrich 2019. SwiGLU: Shazeer 2020. RoPE: Su et al. 2021 (RoFormer), applied to
*adjacent* pairs (x[2k], x[2k+1]) exactly as assignment 1 does, not the "rotate-half" layout.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from ..timing import cpu_contended

# Rows at or below which the CPU few-row path of `Linear` beats one MKL gemm call (measured here on
# the weights of a 330 MB model, 2 idle threads: 1 row 18 -> 10 ms, 8 rows 29 -> 18 ms, 32 rows 55 -> 44 ms).
# On an oversubscribed CPU (other processes busy) the split waits for its slowest thread, which
# shares a core: it then loses to MKL's one-thread kernel, so it is skipped while other processes
# keep a core busy (`timing.cpu_contended`, re-read at most every 0.25 s).
_SPLIT_MAX_ROWS = 64
_SPLIT_ENABLED = True


@contextlib.contextmanager
def few_row_split(enabled: bool):
    """Turn the CPU few-row path of `Linear` on or off (benchmarks compare both)."""
    global _SPLIT_ENABLED
    previous, _SPLIT_ENABLED = _SPLIT_ENABLED, bool(enabled)
    try:
        yield
    finally:
        _SPLIT_ENABLED = previous


def streaming_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # (..., d_in), (d_out, d_in) -> (..., d_out)
    """Rows times W^T written as a multiply and a sum, for a compiled batch-1 decode graph on the CPU.

    Eagerly this would materialise a (d_out, M, d_in) product; under `torch.compile` the multiply and
    the sum fuse into one vectorised loop over W's rows, split across all threads, that reads each
    weight once, where MKL's matrix-vector kernel runs on one thread (`bench generation`: the compiled
    fp32 step of the 88M preset moves ~77% of the measured bandwidth in weights, the same model on
    `F.linear` ~33%). Used for one row only: with a batch size that the
    graph keeps symbolic, the generated loop over M is not vectorised and runs ~10x slower than a gemm.
    Accumulates in fp32 (bf16 weights are upcast inside the loop); the summation order differs from
    a gemm's, so results equal `F.linear`'s to rounding, not bit for bit.
    """
    rows = x.reshape(-1, x.shape[-1])                                     # (M, d_in)
    out = (w.float()[:, None, :] * rows.float()[None]).sum(-1)             # (d_out, M)
    return out.t().reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)


class Linear(nn.Linear):
    """A bias-free linear layer, y = x W^T with W of shape (d_out, d_in) as in assignment 1.

    Decode multiplies a handful of rows by every weight matrix: memory-bound matrix-vector work.
    On the CPU, MKL runs that on one thread, leaving half the memory bandwidth of a 2-core machine
    unused. For few-row inputs in inference we therefore split W's output rows into one block per
    thread (a free view) and let `bmm` stream the blocks in parallel. Same numbers, ~1.5x faster decode.
    Inside a compiled graph (`generation.compile_decode`) one row goes through `streaming_matmul`
    instead, which the compiler turns into a parallel streaming loop.
    """

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_in) -> (..., d_out)
        w = self.weight
        if torch.compiler.is_compiling():   # the thread count is a Python-side fact a graph must not read
            if x.device.type == "cpu" and math.prod(x.shape[:-1]) == 1 and not torch.is_grad_enabled():
                return streaming_matmul(x, w)
            return F.linear(x, w)
        P = torch.get_num_threads()
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if (_SPLIT_ENABLED and P > 1 and 0 < rows <= _SPLIT_MAX_ROWS and x.device.type == "cpu"
                and not torch.is_grad_enabled() and w.shape[0] % P == 0 and w.is_contiguous()
                and x.dtype == w.dtype and not cpu_contended()):
            blocks = w.view(P, w.shape[0] // P, w.shape[1])                       # (P, d_out/P, d_in), free
            x2 = x.reshape(1, rows, x.shape[-1]).expand(P, -1, -1)                # (P, M, d_in)
            y = torch.bmm(x2, blocks.transpose(1, 2))                              # (P, M, d_out/P)
            return rearrange(y, "P M O -> M (P O)").reshape(*x.shape[:-1], w.shape[0])
        return F.linear(x, w)


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
        self.proj = Linear(first.in_features, sum(self.splits), device=w.device, dtype=w.dtype)
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
    bad = {n: type(m).__name__ for n, m in parts.items() if type(m) not in (Linear, nn.Linear) or m.bias is not None}
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
    """Undo `fuse_linears`: the parts come back as plain `Linear`s holding their rows of the fused weight."""
    fused = module._modules[fused_name]
    if type(fused.proj) not in (Linear, nn.Linear):
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
            lin = Linear(w.shape[1], r.shape[0], device=w.device, dtype=w.dtype)
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
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)
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
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device=device), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of the last dim of `x` (..., T, H) by the angles in cos/sin (..., T, H/2).

    cos/sin broadcast against x's leading dims, so per-sequence positions (B, 1, T, H/2) work too.
    The pair (x[2k], x[2k+1]) is the complex number x[2k] + i x[2k+1]; rotating it by angle a is
    multiplying by cos a + i sin a: one complex multiply instead of a dozen real ops per call.
    """
    if torch.compiler.is_compiling():   # the compiler fuses real ops but cannot generate complex ones
        a, b = x.float().unflatten(-1, (-1, 2)).unbind(-1)                               # (..., T, H/2) each
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).to(x.dtype)
    rotation = torch.complex(cos.float(), sin.float())                                  # (..., T, H/2)
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())         # (..., T, H/2)
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)                 # (..., T, H)


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
