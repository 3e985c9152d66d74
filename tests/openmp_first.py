"""Imported first by conftest.py: the suite runs under the CLI's OpenMP wait policy, applied before torch
loads as `python -m cs336_inference` applies it (see cs336_inference/workshop/openmp.py). Importing the
package itself changes nothing in the environment."""

from cs336_inference.workshop.openmp import apply_wait_policy

APPLIED = apply_wait_policy()   # what it set ({} where the environment had a policy already)
