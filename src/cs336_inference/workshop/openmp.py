"""OpenMP's wait policy, set before torch loads its OpenMP runtime (this module must not import torch).

torch's CPU kernels run on OpenMP worker threads. Between parallel regions an idle worker spins for
a while so the next region starts a few microseconds sooner. On a shared 2-core machine that spinning
can steal the core another process, or our own main thread, needs; with OMP_WAIT_POLICY=PASSIVE idle
workers sleep instead, but waking a sleeping worker costs tens of microseconds per region, and a
batch-1 decode step is a chain of short regions with serial work (attention, norms, Python between
steps) in the gaps. So we set PASSIVE with a spin, GOMP_SPINCOUNT=300000 (GNU OpenMP, which torch's
Linux wheels use; a few milliseconds by its own estimate of spins per microsecond, and the count it uses
when no policy is set): long enough that a worker does not fall asleep inside a decode step, then it sleeps.
An earlier, shorter spin (10000) let workers fall asleep between the regions of a step, which made
the 2-thread step slower, idle and busy (`bench thread_policy` compares the policies in one run). What keeps
a spinning worker off a contended core is `cpu_tuning.tune_for_cpu`: a tuned model drops a decode step
to one thread while another process holds a core, so no worker spins against it.

Why importing the package sets these (and nothing else happens at import): the runtime reads them
once, when torch is imported, so no function called later (`tune_for_cpu`, `apply_thread_policy`) can
apply them, and the CLI is not the only entry point: notebooks, pytest, the lecture script and
students' own scripts import the package first and would otherwise run with OpenMP's long spin.
The setting changes no result (only how idle workers wait), never overrides a value already in the
environment (`setdefault`; an explicit ACTIVE keeps OpenMP's own spin), happens only when the package
is imported before torch (`TORCH_LOADED_FIRST` says when it was too late), and is reported
(`python -m cs336_inference info`, every benchmark's JSON). Everything that changes how the model
computes (thread counts, the few-row split, streaming matmuls, one thread under contention) is opt in:
`apply_thread_policy` and `cpu_tuning.tune_for_cpu`. `cs336_inference/__init__.py` imports this module
before anything imports torch.
"""

from __future__ import annotations

import os
import sys

# True if torch (and its OpenMP runtime) was loaded before this package: setting the variable is then too late.
TORCH_LOADED_FIRST = "torch" in sys.modules
SPIN_COUNT = "300000"

if not TORCH_LOADED_FIRST:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if os.environ["OMP_WAIT_POLICY"].upper() == "PASSIVE":   # an explicit ACTIVE keeps OpenMP's long spin
        os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)

_POLICY = os.environ.get("OMP_WAIT_POLICY")  # what the OpenMP runtime read (best guess if torch came first)
_SPIN = os.environ.get("GOMP_SPINCOUNT")


def wait_policy() -> str:
    """The wait policy OpenMP runs with in this process ('PASSIVE', 'ACTIVE', or 'default (spinning)')."""
    return _POLICY.upper() if _POLICY else "default (spinning)"


def spin_count() -> str:
    """GNU OpenMP's spin count before an idle worker sleeps (GOMP_SPINCOUNT), or 'default'."""
    return _SPIN if _SPIN else "default"
