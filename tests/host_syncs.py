"""Count the host syncs a piece of code would make on a GPU: every op that reads a tensor's value
back to Python or copies device memory to the host. On a CPU the same ops run without waiting, so
counting them here is how a CPU-only test proves a decode step is sync-free (and so CUDA-graph safe).

    with HostSyncCounter() as syncs:
        decode_one_token(model, token, cache)
    assert syncs.count == 0, syncs.seen

Counted: `aten._local_scalar_dense` (what `.item()`, `int(t)`, `float(t)`, `bool(t)` and `.tolist()`
end in), `aten.item`, `aten.is_nonzero` (`if tensor:`), `aten.nonzero` (its output shape depends on the
values), and copies from a non-CPU device to the CPU (`aten._to_copy` / `aten.copy_`). Ops that a
compiled graph runs inside its own kernels are not seen; the ones it hands back to eager PyTorch are.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero"}


def _device_of(x):
    return x.device if isinstance(x, torch.Tensor) else None


class HostSyncCounter(TorchDispatchMode):
    """A dispatch mode that records every host-syncing op (name, shape of its input) run under it."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, tuple]] = []

    @property
    def count(self) -> int:
        return len(self.seen)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        first = args[0] if args else None
        if name in _READS:
            self.seen.append((name, tuple(first.shape) if isinstance(first, torch.Tensor) else ()))
        elif name in ("aten::_to_copy", "aten::copy_"):
            src = _device_of(args[1]) if name == "aten::copy_" else _device_of(first)
            dst = _device_of(first) if name == "aten::copy_" else kwargs.get("device")
            if src is not None and src.type != "cpu" and dst is not None and torch.device(dst).type == "cpu":
                self.seen.append((name + " device->host", tuple(first.shape)))
        return func(*args, **kwargs)


def profiled_host_syncs(fn) -> list[str]:
    """The host-syncing ops `fn()` ran, from torch's profiler: the way to count inside a compiled step
    (torch.compile refuses to run under a dispatch mode). On CUDA it also counts device->host memcpys."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        fn()
    names = [event.name for event in prof.events()]
    return [n for n in names if n in _READS or "DtoH" in n or "Device -> Host" in n]
