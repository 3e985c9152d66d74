"""No function or method in the package (or the lecture) above cyclomatic complexity 20, measured with radon.

Not graded: this checks the library's own shape (issue 47, "simpler inside"). radon counts one per
decision (if, for, while, except, boolean operator, comprehension clause, ...) plus one; above 20 a
function is hard to read top to bottom and hard to test branch by branch, so it is split into named
helpers. Classes are not checked as such: radon's class score is its methods' average plus one, and
each method is checked on its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

radon_complexity = pytest.importorskip("radon.complexity", reason="radon is in the dev extra")

REPO = Path(__file__).resolve().parents[2]
ROOTS = (REPO / "src" / "cs336_inference", REPO / "lecture")
MAX_CC = 20



def _functions(path: Path):
    """(qualified name, line, CC) of every function, method and closure in one file."""
    blocks = radon_complexity.add_inner_blocks(radon_complexity.cc_visit(path.read_text()))
    for block in blocks:
        if block.letter in ("F", "M"):   # functions and methods; "C" is a class's average
            yield block.fullname, block.lineno, block.complexity


def _over_the_bar() -> list[tuple[str, str, int, int]]:
    found = []
    for root in ROOTS:
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            found += [(rel, name, line, cc) for name, line, cc in _functions(path) if cc > MAX_CC]
    return found


def test_no_function_above_cc_20():
    offenders = [f"{rel}:{line} {name} CC {cc}" for rel, name, line, cc in _over_the_bar()]
    assert not offenders, (f"{len(offenders)} function(s) above CC {MAX_CC} (radon); split them into "
                           "named helpers:\n" + "\n".join(offenders))


def test_the_measure_sees_a_complex_function(tmp_path):
    """The checker itself: 21 `if`s score 22 (one per decision plus one), a conditional expression 2."""
    branches = "\n".join(f"    if x == {i}:\n        return {i}" for i in range(21))
    source = f"def busy(x):\n{branches}\n    return -1\n\ndef calm(x):\n    return x if x else 0\n"
    path = tmp_path / "m.py"
    path.write_text(source)
    scores = {name: cc for name, _, cc in _functions(path)}
    assert scores == {"busy": 22, "calm": 2}
