"""OpenMP's wait policy, set before torch loads its OpenMP runtime (this module must not import torch).

torch's CPU kernels run on OpenMP worker threads. Between parallel regions an idle worker spins for
a while (the default wait policy) so the next region starts a few microseconds sooner. On a shared
2-core machine that spinning steals the core another process, or our own main thread, needs; every
op then waits for a descheduled thread and small kernels become 10-100x slower. With
OMP_WAIT_POLICY=PASSIVE idle workers sleep instead. The OpenMP runtime reads the variable once, when
torch is imported, so `cs336_inference/__init__.py` imports this module before anything imports
torch: importing the package first applies it. A value you set yourself always wins.
"""

from __future__ import annotations

import os
import sys

# True if torch (and its OpenMP runtime) was loaded before this package: setting the variable is then too late.
TORCH_LOADED_FIRST = "torch" in sys.modules

if not TORCH_LOADED_FIRST:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

_POLICY = os.environ.get("OMP_WAIT_POLICY")  # what the OpenMP runtime read (best guess if torch came first)


def wait_policy() -> str:
    """The wait policy OpenMP runs with in this process ('PASSIVE', 'ACTIVE', or 'default (spinning)')."""
    return _POLICY.upper() if _POLICY else "default (spinning)"
