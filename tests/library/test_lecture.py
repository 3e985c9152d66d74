"""The executable lecture (the README's main job) runs end to end through the CLI, its assertions
hold, and it leaves the git tree as it was; and its live numbers are deterministic: a second run of the
whole lecture (the edtrace trace, see conftest.py) prints the same narration, number for number.

The serving and paging demos run on a simulated clock with fixed step costs (`Engine(step_time=...)`),
so their throughput, TTFT, concurrency and waste are identical run to run. Only the lines the lecture
marks "timed just now" (this machine's roofline, one TTFT) measure the wall clock."""

import difflib
import re

import pytest

# Under pytest-xdist (`.ci/run`: the slow tests on two workers, --dist loadgroup) the tests that read the
# lecture's runs share one worker, so each whole-lecture run (a session fixture) happens once (conftest).
pytestmark = pytest.mark.xdist_group("lecture")

# edtrace's own lines in the trace run's stdout: the steps, the inspected values, its banner
EDTRACE_LINE = re.compile(r"^(  \[\d+ \S+:\d+\] |    env: |WARNING: |Executing |Saving trace |\d+ steps$)")


def narration(stdout: str) -> list[str]:
    """The narration as items: an unindented line starts one, indented lines (textwrap's continuation
    lines, links, figures) continue it. Items that measure the wall clock ("timed just now") are left out."""
    items: list[str] = []
    for line in stdout.splitlines():
        if EDTRACE_LINE.match(line):
            continue
        if line.startswith("  ") and items:
            items[-1] += "\n" + line
        else:
            items.append(line)
    return [item for item in items if "timed just now" not in item]


def test_narration_parsing_skips_edtrace_lines_and_timed_items():
    traced = ("Executing lecture_10...\nA step costs 10 ms\n  [3 lecture_10.py:12] text('x')\n    env: x = 1\n"
              "  -> [Kwon+ 2023] https://arxiv.org/abs/2309.06180\nWARNING: variable y not found in locals\n"
              "Peak 12 GFLOP/s (timed just now) and\n  wrapped 3.1 GB/s\n1266 steps\n")
    assert narration(traced) == ["A step costs 10 ms\n  -> [Kwon+ 2023] https://arxiv.org/abs/2309.06180"]


@pytest.mark.slow
def test_lecture_runs_end_to_end(lecture_cli_run):
    run = lecture_cli_run
    assert run.returncode == 0, run.failure()
    assert not run.tree_change, f"the lecture changed `git status` (outputs go to ignored folders):\n{run.tree_change}"
    for section in ("landscape", "reduce_kv_cache_size", "quantization", "continuous_batching", "summary"):
        assert section in run.stdout


@pytest.mark.slow
def test_two_runs_print_the_same_numbers(lecture_cli_run, lecture_trace_run):
    """The CLI run and the trace run are two processes running the whole lecture: every narrated
    number must agree (the serving demos' simulated clock included)."""
    assert lecture_cli_run.returncode == 0, lecture_cli_run.failure()
    assert lecture_trace_run.returncode == 0, lecture_trace_run.failure()
    first, second = narration(lecture_cli_run.stdout), narration(lecture_trace_run.stdout)
    demos = [item for item in first if "sequences at once" in item or "Continuous batching:" in item]
    assert len(demos) >= 3, "the serving and paging demos' numbers are missing from the narration"
    assert first == second, "\n".join(difflib.unified_diff(first, second, "CLI run", "trace run", lineterm="", n=1))
