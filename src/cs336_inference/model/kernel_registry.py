"""Kernel registries: the model's attention and the quantized linears' matmuls look their kernel up by name.

The teaching core registers its own kernels (attention: "reference", the hand-written softmax, and "sdpa",
torch's fused one; int4 linears: "torch", torch's int4pack kernel). Faster, machine-specific kernels live
in the performance workshop (`cs336_inference.workshop`), which registers them here when it is used
(`workshop.register_kernels()`); the core never imports it. A name chosen at an edge
(`TransformerLM.set_attention_kernel`, a layer being packed) is checked there, once: the per-token path
only reads the registry's plain dict.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# How to get a kernel that only the workshop registers: the error for a missing name says so.
WORKSHOP_HINT = ("the performance workshop registers it: call `cs336_inference.workshop.register_kernels()` "
                 "first")


class KernelRegistry:
    """Named kernels of one kind. `kernels` is a plain dict (name -> kernel) that hot paths index directly;
    `register`, `check` and `get` are the edges, with clear errors."""

    def __init__(self, kind: str, workshop: tuple[str, ...] = ()):
        self.kind = kind                      # what a kernel here is, for messages ("attention kernel")
        self.kernels: dict[str, Any] = {}
        self.workshop = workshop              # names only the workshop registers (the error says how to get them)
        self._why_not: dict[str, Callable[[], str | None]] = {}

    def register(self, name: str, kernel, why_unavailable: Callable[[], str | None] | None = None,
                 replace: bool = False):
        """Add `kernel` under `name` and return it. why_unavailable: called when the name is chosen, returns
        None where the kernel runs here, else why not (a kernel that needs a CPU feature or a compiler).
        A name already registered is refused unless `replace` (registering the same kernel again is a no-op)."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind} name must be a non-empty str, got {type(name).__name__} {name!r}")
        if kernel is None:
            raise TypeError(f"{self.kind} {name!r}: kernel must not be None")
        if why_unavailable is not None and not callable(why_unavailable):
            raise TypeError(f"{self.kind} {name!r}: why_unavailable must be callable or None, got "
                            f"{type(why_unavailable).__name__}")
        if name in self.kernels and self.kernels[name] is not kernel and not replace:
            raise ValueError(f"{self.kind} {name!r} is registered already; pass replace=True to replace it")
        self.kernels[name] = kernel
        if why_unavailable is None:
            self._why_not.pop(name, None)
        else:
            self._why_not[name] = why_unavailable
        return kernel

    def unregister(self, name: str) -> None:
        """Remove `name` (ValueError if it is not registered)."""
        if name not in self.kernels:
            self._missing(name)
        del self.kernels[name]
        self._why_not.pop(name, None)

    def names(self) -> tuple[str, ...]:
        """The registered names, in the order they were registered."""
        return tuple(self.kernels)

    def __contains__(self, name) -> bool:
        return name in self.kernels

    def why_unavailable(self, name: str) -> str | None:
        """None where the registered kernel `name` runs here, else why not."""
        why = self._why_not.get(name)
        return None if why is None else why()

    def check(self, name) -> str:
        """`name` if a kernel is registered under it and can run here, else a ValueError that lists the
        registered names (and, for a workshop kernel not registered yet, how to get it)."""
        if not isinstance(name, str):
            raise TypeError(f"{self.kind} must be a str, one of {self.names()}, got {type(name).__name__} {name!r}")
        if name not in self.kernels:
            self._missing(name)
        if (why := self.why_unavailable(name)) is not None:
            others = tuple(n for n in self.names() if n != name)
            raise ValueError(f"{self.kind} {name!r} cannot run here: {why}; use one of {others}")
        return name

    def get(self, name):
        """The kernel registered under `name` (checked as `check` does)."""
        return self.kernels[self.check(name)]

    def _missing(self, name):
        hint = f" ({name!r}: {WORKSHOP_HINT})" if name in self.workshop else ""
        raise ValueError(f"{self.kind} must be one of the registered {self.names()}, got {name!r}{hint}")

    def __repr__(self) -> str:
        return f"KernelRegistry({self.kind!r}, {list(self.names())})"


__all__ = ["KernelRegistry", "WORKSHOP_HINT"]
