"""The reference solution, alternatives to the Transformer: one step of a fixed-state layer's recurrence.

See the package docstring; each function is a thin wrapper over the library."""

from __future__ import annotations

import torch

from ...model import state_cache as _state
from ..registry import graded


@graded("alternatives")
def fixed_state_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor | None,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token through a fixed-state layer: gated linear attention, the recurrent form of linear attention
    (Katharopoulos et al. 2020; decay a = 1) and of Mamba-2's SSD (Dao & Gu 2024; key dt B, query C, value x).

    q, k: (B, N, F), this token's query and key per head; v: (B, N, Hv), its value; log_decay: (B, N), log a
    of this token's decay a in (0, 1], or None for a = 1 (plain linear attention, no decay); state: (B, N, F,
    Hv), the state S before this token (zeros before the first). Per head, first update, then read:
        S' = a S + k v^T        (the outer product of this token's key and value)
        y  = q^T S'             (the state now includes this token)
    Returns (y (B, N, Hv), S' (B, N, F, Hv)). Run token by token from a zero state, the outputs equal the
    parallel (quadratic) form y_t = sum_{j <= t} (a_{j+1} ... a_t) (q_t . k_j) v_j; nothing grows with t.
    """
    new_state, _ = _state.next_state(k[:, :, None], v[:, :, None],
                                     None if log_decay is None else log_decay[..., None], state)
    return _state.read_state(q[:, :, None], new_state)[:, :, 0], new_state
