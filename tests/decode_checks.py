"""What the tests of our decode kernels share: a record of the ops a piece of code dispatches, and the
check that a compiled decode step gives the logits of the eager one."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import adapters


class OpCalls(TorchDispatchMode):
    """Records the name of every op dispatched inside it (ops a compiled graph runs itself are not seen)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def assert_compiled_decode_matches_eager(model, step, ids: torch.Tensor, prefill: int, atol: float) -> None:
    """Prefill ids[:, :prefill] (B, T) into two caches, then decode the rest one token at a time: `step`
    (a `compile_decode` step) on one cache, `decode_one_token` on the other; the logits agree to atol."""
    B, T = ids.shape
    eager_cache, cache = adapters.make_kv_cache(model, B, T + 2), adapters.make_kv_cache(model, B, T + 2)
    with torch.no_grad():
        adapters.run_model(model, ids[:, :prefill], eager_cache)
        adapters.run_model(model, ids[:, :prefill], cache)
        for t in range(prefill, T):
            expected = adapters.run_decode_one_token(model, ids[:, t], eager_cache)
            torch.testing.assert_close(step(ids[:, t], cache).float(), expected.float(), rtol=0, atol=atol)
