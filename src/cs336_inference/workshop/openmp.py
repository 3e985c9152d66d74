"""OpenMP's wait policy, applied explicitly before torch loads its OpenMP runtime (this module must not import torch).

torch's CPU kernels run on OpenMP worker threads. Between parallel regions an idle worker spins for
a while so the next region starts a few microseconds sooner. On a shared 2-core machine that spinning
can steal the core another process, or our own main thread, needs; with OMP_WAIT_POLICY=PASSIVE idle
workers sleep instead, but waking a sleeping worker costs tens of microseconds per region, and a
batch-1 decode step is a chain of short regions with serial work (attention, norms, Python between
steps) in the gaps. So the policy is PASSIVE with a spin, GOMP_SPINCOUNT=300000 (GNU OpenMP, which torch's
Linux wheels use; a few milliseconds by its own estimate of spins per microsecond, and the count it uses
when no policy is set): long enough that a worker does not fall asleep inside a decode step, then it sleeps.
An earlier, shorter spin (10000) let workers fall asleep between the regions of a step, which made
the 2-thread step slower, idle and busy (`bench thread_policy` compares the policies in one run). What keeps
a spinning worker off a contended core is `cpu_tuning.tune_for_cpu`: a tuned model drops a decode step
to one thread while another process holds a core, so no worker spins against it.

Where the policy is applied (the decision). The runtime reads these variables once, when torch is
imported, so they can only be set by whoever starts the process, before anything imports torch:
- `python -m cs336_inference` (and the `cs336-inference` script): `cs336_inference.__main__` calls
  `apply_wait_policy()` first, then imports the CLI. Every fast command and every `bench` runs there.
- the benchmarks' own child processes get the policy they measure in their environment
  (`bench thread_policy`); a benchmark records the policy it ran under (`device.describe_machine`).
- the test suite applies it in `tests/conftest.py`, before torch.
Importing `cs336_inference` (or any part of it) changes nothing in the environment: the lecture,
notebooks and students' scripts run with OpenMP's own defaults, which differ from this policy only in
how idle workers wait, never in a result. A script that wants the CLI's behaviour calls
`cs336_inference.workshop.apply_openmp_policy()` before importing torch, or exports the variables.
`apply_wait_policy` never overrides a value already in the environment (an explicit ACTIVE keeps
OpenMP's long spin), sets nothing once torch is loaded (too late to matter), and returns what it set.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = "300000"
VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def apply_wait_policy(environ=None) -> dict[str, str]:
    """Set OMP_WAIT_POLICY=PASSIVE and GOMP_SPINCOUNT=`SPIN_COUNT` in `environ` (default `os.environ`)
    where they are unset, and return the variables it set ({} when it set none). Sets nothing once torch
    is imported: its OpenMP runtime has read the environment already (`torch_loaded` says so)."""
    environ = os.environ if environ is None else environ
    if torch_loaded():
        return {}
    changed = {}
    if "OMP_WAIT_POLICY" not in environ:
        environ["OMP_WAIT_POLICY"] = changed["OMP_WAIT_POLICY"] = "PASSIVE"
    if environ["OMP_WAIT_POLICY"].upper() == "PASSIVE" and "GOMP_SPINCOUNT" not in environ:
        environ["GOMP_SPINCOUNT"] = changed["GOMP_SPINCOUNT"] = SPIN_COUNT   # an explicit ACTIVE keeps its spin
    return changed


def torch_loaded() -> bool:
    """True once torch (and its OpenMP runtime) is imported in this process: too late to set the policy."""
    return "torch" in sys.modules


__all__ = ["SPIN_COUNT", "VARIABLES", "apply_wait_policy", "torch_loaded"]
