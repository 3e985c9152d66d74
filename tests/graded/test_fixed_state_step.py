"""Graded: one step of a fixed-state layer (gated linear attention: linear attention, Mamba-2's SSD).
References are written here from the equations in float64: the parallel (quadratic, attention-like) form
y_t = sum_{j <= t} (a_{j+1} ... a_t) (q_t . k_j) v_j + (a_1 ... a_t) q_t^T S_0 as a double loop over
positions, and the final state as the explicit sum S_T = (a_1 ... a_T) S_0 + sum_j (a_{j+1} ... a_T) k_j v_j^T."""

import pytest
import torch
from adapters import run_fixed_state_step


def ref_parallel(q, k, v, log_decay, state0):
    """q, k (B, N, T, F), v (B, N, T, Hv), log_decay (B, N, T) or None, state0 (B, N, F, Hv) ->
    (y (B, N, T, Hv), S_T (B, N, F, Hv)), every product of decays written out."""
    q, k, v, s0 = q.double(), k.double(), v.double(), state0.double()
    B, N, T, _ = q.shape
    a = torch.ones(B, N, T, dtype=torch.float64) if log_decay is None else log_decay.double().exp()
    y = torch.zeros(B, N, T, v.shape[-1], dtype=torch.float64)
    for t in range(T):
        y[:, :, t] = torch.einsum("bnf,bnfh->bnh", q[:, :, t], s0) * a[:, :, :t + 1].prod(-1)[..., None]
        for j in range(t + 1):
            weight = (q[:, :, t] * k[:, :, j]).sum(-1) * a[:, :, j + 1:t + 1].prod(-1)      # (B, N)
            y[:, :, t] += weight[..., None] * v[:, :, j]
    final = s0 * a.prod(-1)[..., None, None]
    for j in range(T):
        final = final + a[:, :, j + 1:].prod(-1)[..., None, None] * k[:, :, j, :, None] * v[:, :, j, None, :]
    return y, final


def _inputs(seed, B=2, N=3, T=7, F=4, Hv=5, decay=True):
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, N, T, F, generator=g), torch.randn(B, N, T, F, generator=g)
    v = torch.randn(B, N, T, Hv, generator=g)
    # decays a in [e^-2, e^-0.1]: far from 1, so decaying before or after adding k v^T (or not at all) differs
    log_decay = -(0.1 + 1.9 * torch.rand(B, N, T, generator=g)) if decay else None
    return q, k, v, log_decay


def _run_steps(q, k, v, log_decay, state):
    ys = []
    for t in range(q.shape[2]):
        y, state = run_fixed_state_step(q[:, :, t], k[:, :, t], v[:, :, t],
                                        None if log_decay is None else log_decay[:, :, t], state)
        assert y.shape == v[:, :, t].shape and state.shape == (*q.shape[:2], q.shape[-1], v.shape[-1])
        ys.append(y)
    return torch.stack(ys, dim=2), state


@pytest.mark.parametrize("decay", [True, False], ids=["ssd-decay", "linear-attention"])
def test_steps_from_a_zero_state_equal_the_parallel_form(decay):
    q, k, v, log_decay = _inputs(0, decay=decay)
    state = torch.zeros(*q.shape[:2], q.shape[-1], v.shape[-1])
    ys, final = _run_steps(q, k, v, log_decay, state)
    want_y, want_state = ref_parallel(q, k, v, log_decay, state)
    torch.testing.assert_close(ys.double(), want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final.double(), want_state, atol=1e-4, rtol=1e-4)


def test_a_nonzero_starting_state_decays_with_every_token():
    """A prefix already absorbed (S_0 != 0): its contribution shrinks by each token's decay."""
    q, k, v, log_decay = _inputs(1, T=5)
    state = torch.randn(*q.shape[:2], q.shape[-1], v.shape[-1], generator=torch.Generator().manual_seed(2))
    ys, final = _run_steps(q, k, v, log_decay, state)
    want_y, want_state = ref_parallel(q, k, v, log_decay, state)
    torch.testing.assert_close(ys.double(), want_y, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final.double(), want_state, atol=1e-4, rtol=1e-4)


def test_one_step_by_hand():
    """B = N = 1, F = 2, Hv = 1: S = [[1], [2]], a = 1/2, k = [1, 0], v = [4], q = [1, 1]:
    S' = S / 2 + k v^T = [[4.5], [1]] and y = q^T S' = 5.5 (updating first: the token sees itself)."""
    state = torch.tensor([[[[1.0], [2.0]]]])
    y, new = run_fixed_state_step(torch.tensor([[[1.0, 1.0]]]), torch.tensor([[[1.0, 0.0]]]),
                                  torch.tensor([[[4.0]]]), torch.log(torch.tensor([[0.5]])), state)
    torch.testing.assert_close(new, torch.tensor([[[[4.5], [1.0]]]]))
    torch.testing.assert_close(y, torch.tensor([[[5.5]]]))
    assert torch.equal(state, torch.tensor([[[[1.0], [2.0]]]])), "the input state must not be modified in place"
