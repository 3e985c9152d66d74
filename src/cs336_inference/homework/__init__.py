"""The homework: the registry of graded functions, their reference solution, and the student skeleton.

`registry` (GRADED, AREAS, the `graded` marker), `reference` (the reference solution the autograder
uses by default), `skeleton` (`homework init DIR`). The autograder itself is `pytest tests/graded`
(`--impl PACKAGE` grades a student's package; see tests/adapters.py and tests/grading.py).
"""

from .registry import AREAS, FORMER_NAMES, GRADED, GradedEntry, graded

__all__ = ["AREAS", "FORMER_NAMES", "GRADED", "GradedEntry", "graded", "graded_names"]


def graded_names() -> list[str]:
    """Every graded function/class name, in the reference's order (importing the reference registers them)."""
    from . import reference  # noqa: F401
    return list(GRADED)
