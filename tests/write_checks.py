"""Indexed writes that hit one slot twice in one op: which value lands there is undefined (it differs between
devices), so a graded buffer's append must write each slot once (tests/graded/test_rolling_buffer.py).

    with adapters.watching(DuplicateWrites) as mode:
        buffer.append(k, v)
    assert not mode.duplicates

A watcher of graded calls (tests/adapters.py `watching`): with a student's package it runs in the worker
process around each graded call (tests/sandbox.py), which sends back `findings()`; `merge` adds them here.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class DuplicateWrites(TorchDispatchMode):
    """Records indexed writes (index_put_, index_copy_) whose index names one slot twice."""

    def __init__(self):
        super().__init__()
        self.duplicates: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in ("index_put_", "index_put", "_index_put_impl_"):
            for index in args[1]:
                if index is not None and index.numel() != torch.unique(index).numel():
                    self.duplicates.append(name)
        elif name in ("index_copy_", "index_copy") and args[2].numel() != torch.unique(args[2]).numel():
            self.duplicates.append(name)
        return func(*args, **kwargs)

    def findings(self) -> list[str]:
        return list(self.duplicates)

    def merge(self, findings) -> None:
        if type(findings) is not list or not all(type(f) is str for f in findings):
            raise AssertionError("a watcher's findings came back malformed")
        self.duplicates.extend(f[:100] for f in findings)
