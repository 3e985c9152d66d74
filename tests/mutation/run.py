"""The mutation check of the autograder: plant realistic bugs one at a time and show the graded tests fail.

    python tests/mutation/run.py                 # everything (3-5 min on 2 shared cores)
    python tests/mutation/run.py --only NAME ... # some mutants (names from mutants.py)
    python tests/mutation/run.py --json out.json
    python tests/mutation/run.py --all-failures  # every failing test per mutant, not only the first (slower)
    python tests/mutation/run.py --shard 1/2     # every second mutant and stub from the second; controls in 0/2

1. control: an unmodified copy of the package graded through --impl must score 100%; the generated
   skeleton must score 0 with every graded name reported "not implemented";
2. graded mutants (mutants.MUTANTS): copy src/cs336_inference to a temporary folder as package `mutant_NN`,
   apply the edits, grade `mutant_NN.homework.reference` (the reference solution with one change) with
   `pytest tests/graded --impl ...`; killed = at least one graded test fails;
3. library stubs (mutants.LIBRARY_STUBS): run the library tests of that part with the stub patched in.
Prints each mutant, whether it was killed and by which tests, and the mutation score over the
non-equivalent mutants; exits 1 if a control fails, an equivalent mutant is killed, or the score < 95%.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "cs336_inference"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutants import LIBRARY_STUBS, MUTANTS, Mutant  # noqa: E402

GOAL = 0.95
RETRY_TIMEOUT = 300.0        # seconds a test that timed out gets when it is graded again alone (failed_tests)

# Which graded test file exercises each part of the package (first match wins). A mutant is graded on that
# file alone first, stopping at the first failure, so a killed mutant costs one file's collection and run;
# one that survives it is then graded on the whole suite.
FIRST_TESTS = [("generation/sampling", "test_sampling_rules.py"),
               ("generation/generate", "test_generation_loop.py"),
               ("model/kv_cache", "test_kv_cache_buffer.py"),
               ("model/layers", "test_norm_and_ffn.py"),
               ("compression/", "test_compression.py"),
               ("data/evaluation", "test_bits_per_byte.py"),
               ("quantization/awq", "test_awq_and_qat.py"),
               ("quantization/qat", "test_awq_and_qat.py"),
               ("serving/kv_cache_manager", "test_block_manager.py"),
               ("serving/scheduler", "test_block_manager.py"),
               ("generation/speculative_rule", "test_speculative_accept.py"),
               ("accounting/", "test_accounting_formulas.py"),
               ("quantization/", "test_quantization_kernels.py"),
               ("model/rolling_kv_cache", "test_rolling_buffer.py"),
               ("model/", "test_attention_kernels.py"),
               ("homework/reference/attention", "test_attention_kernels.py"),
               ("serving/", "test_paged_serving.py"),
               ("data/", "test_batch_sampler.py")]


def first_tests(mutant: Mutant) -> Path | None:
    for prefix, test_file in FIRST_TESTS:
        if mutant.path.startswith(prefix):
            return ROOT / "tests" / "graded" / test_file
    return None


def compiled_template(dest: Path) -> Path:
    """src/cs336_inference copied to dest with every module's bytecode written beside it (compileall
    writes it even under PYTHONDONTWRITEBYTECODE), for `copy_package` to copy from: importing a mutant
    then compiles only its edited module, where compiling all ~100 cost each mutant ~0.3 s."""
    shutil.copytree(PACKAGE, dest, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    compileall.compile_dir(dest, quiet=1)
    return dest


def copy_package(source: Path, dest: Path, mutant: Mutant | None = None) -> None:
    """The package at `source` -> dest (a package named dest.name: every internal import is relative).
    Copied with their sources' timestamps, its bytecode files stay valid, but the edited module's is deleted."""
    shutil.copytree(source, dest)
    if mutant is None:
        return
    path = dest / mutant.path
    text = path.read_text()
    for old, new in mutant.edits:
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"mutant {mutant.name}: {old!r} occurs {count} times in {mutant.path} (want 1); "
                             f"update tests/mutation/mutants.py to the current source")
        text = text.replace(old, new)
    path.write_text(text)
    for stale in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        stale.unlink()


def grade(impl: str, workdir: Path, first: Path | None = None, stop_at_first_failure: bool = False) -> dict:
    """pytest tests/graded --impl impl -> the results.json dict. Runs in this process (pytest.main): the
    mutant packages have distinct names and the adapters resolve the implementation at call time, so one
    torch import serves every mutant (~2 s each instead of ~8 s in a fresh process). `first`: a test file
    to grade on alone before the whole suite (only if nothing failed in it, with `stop_at_first_failure`;
    otherwise it runs first within the suite); `stop_at_first_failure`: pytest -x."""
    if first is not None and stop_at_first_failure:
        alone = grade_paths(impl, workdir, [str(first)], True)
        if failed_tests(alone, workdir):
            return alone
    return grade_paths(impl, workdir, ([str(first)] if first is not None else []) + [str(ROOT / "tests" / "graded")],
                       stop_at_first_failure)


def grade_paths(impl: str, workdir: Path, paths: list[str], stop_at_first_failure: bool,
                timeout: float | None = None) -> dict:
    out = workdir / f"{impl.replace('/', '_').replace('.', '_')}.json"
    out.unlink(missing_ok=True)          # never read back an earlier run's results
    with contextlib.redirect_stdout(io.StringIO()):
        pytest.main([*paths, "-q", "--tb=no", "-p", "no:cacheprovider", "-p", "no:unraisableexception",
                     "--impl", impl, "--grade-json", str(out),
                     *(["-x"] if stop_at_first_failure else []),
                     *(["--graded-timeout", str(timeout)] if timeout is not None else [])])
    if not out.exists():
        raise SystemExit(f"grading {impl} wrote no results.json")
    results = json.loads(out.read_text())
    results["impl"] = impl
    return results


def failed_tests(results: dict, workdir: Path | None = None) -> list[str]:
    """The graded tests that failed, less those that -x stopped before they ran (recorded as failed with 0
    points: they say nothing about the mutant; a package that cannot be imported still fails every test).
    With `workdir`, a failure that is only a timeout counts once the test, graded again alone with RETRY_TIMEOUT
    seconds, fails again: on a busy machine (CI runs the shards beside other tests) a sound test can run past
    the default deadline, and neither a kill nor an equivalent's failure may rest on the machine's load."""
    failed = [t for t in results["tests"]
              if t["status"] == "failed" and "the grading run stopped before this test" not in t.get("output", "")]
    names = [t["name"] for t in failed]
    slow = [t["name"] for t in failed if "timed out after" in t.get("output", "")]
    if workdir is None or not slow:
        return names
    again = grade_paths(results["impl"], workdir, [str(ROOT / "tests" / "graded" / name) for name in slow], False,
                        timeout=RETRY_TIMEOUT)
    still = {t["name"] for t in again["tests"] if t["status"] == "failed"}
    return [name for name in names if name not in slow or name in still]


def run_library_stub(name: str, test_file: str) -> list[str]:
    env = {**os.environ, "CS336_LIBRARY_STUB": name,
           "PYTHONPATH": str(Path(__file__).resolve().parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "pytest", test_file, "-q", "--tb=no", "-rf", "-p", "no:cacheprovider",
                           "-p", "library_stubs"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return [line.split(" ", 1)[1].split(" - ")[0] for line in proc.stdout.splitlines() if line.startswith("FAILED ")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="run only these mutants / stubs (skips the controls)")
    parser.add_argument("--json", help="write every result to this file")
    parser.add_argument("--all-failures", action="store_true",
                        help="run every graded test on every mutant (lists all the tests that catch it; slower)")
    parser.add_argument("--shard", default="0/1", metavar="K/N",
                        help="run the K-th of N interleaved shards (the controls run in shard 0); the score is "
                             "the shard's own: merge the shards' JSON for the whole check")
    args = parser.parse_args(argv)
    shard, shards = (int(x) for x in args.shard.split("/"))
    if not 0 <= shard < shards:
        parser.error(f"--shard must be K/N with 0 <= K < N, got {args.shard}")
    selected = set(args.only or [])
    start = time.time()
    report: dict = {"mutants": [], "library_stubs": [], "controls": {}}
    problems = []
    with tempfile.TemporaryDirectory(prefix="cs336-mutants-") as tmp:
        tmp = Path(tmp)
        sys.path.insert(0, str(tmp))        # the mutant packages are imported from here
        template = compiled_template(tmp / "template")
        if not selected and shard == 0:
            copy_package(template, tmp / "mutant_control")
            control = grade("mutant_control.homework.reference", tmp)
            failed = failed_tests(control, tmp)
            report["controls"]["unmodified_copy"] = {"score": control["score"], "failed": failed}
            print(f"control, unmodified copy: {control['output']}")
            if failed:
                problems.append(f"the unmodified copy failed {failed}")
            subprocess.run([sys.executable, "-m", "cs336_inference", "homework", "init", str(tmp / "skeleton")],
                           check=True, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
            skeleton = grade(str(tmp / "skeleton"), tmp)
            report["controls"]["skeleton"] = {"score": skeleton["score"], "output": skeleton["output"]}
            print(f"control, skeleton: {skeleton['output']}")
            if skeleton["score"] != 0 or any(t["status"] == "passed" for t in skeleton["tests"]):
                problems.append("the skeleton scored above 0")
        print(f"\n{'mutant':45s} {'issue':>5s}  killed  by (first of the failing graded tests)")
        for i, mutant in enumerate(MUTANTS):
            if (selected and mutant.name not in selected) or i % shards != shard:
                continue
            package = f"mutant_{i:02d}"
            copy_package(template, tmp / package, mutant)
            failed = failed_tests(grade(f"{package}.homework.reference", tmp, first=first_tests(mutant),
                                        stop_at_first_failure=not args.all_failures), tmp)
            killed = bool(failed)
            report["mutants"].append({"name": mutant.name, "issue": mutant.issue, "what": mutant.what,
                                      "equivalent": mutant.equivalent, "killed": killed, "failed_tests": failed})
            label = "yes" if killed else ("equiv." if mutant.equivalent else "NO")
            first = failed[0] if failed else (mutant.equivalent or "")
            print(f"{mutant.name:45s} {mutant.issue or '':>5}  {label:6s}  {first} "
                  f"{f'(+{len(failed) - 1} more)' if len(failed) > 1 else ''}")
            if mutant.equivalent and killed:
                problems.append(f"{mutant.name} is marked equivalent but {failed[0]} fails on it")
            shutil.rmtree(tmp / package)
        for j, (name, (what, test_file)) in enumerate(LIBRARY_STUBS.items()):
            if (selected and name not in selected) or j % shards != shard:
                continue
            failed = run_library_stub(name, test_file)
            report["library_stubs"].append({"name": name, "what": what, "tests": test_file, "killed": bool(failed),
                                            "failed_tests": failed})
            print(f"library stub {name:32s} killed: {'yes' if failed else 'NO':3s} by {', '.join(failed) or '-'}")
            if not failed:
                problems.append(f"library stub {name} passed {test_file}")
    scored = [m for m in report["mutants"] if not m["equivalent"]]
    killed = sum(m["killed"] for m in scored)
    score = killed / len(scored) if scored else 1.0
    report.update(score=score, killed=killed, non_equivalent=len(scored), seconds=round(time.time() - start, 1))
    print(f"\nmutation score: {killed}/{len(scored)} non-equivalent graded mutants killed ({100 * score:.1f}%), "
          f"{sum(1 for m in report['mutants'] if m['equivalent'])} equivalent; {report['seconds']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if score < GOAL and not selected and shards == 1:
        problems.append(f"mutation score {100 * score:.1f}% < {100 * GOAL:.0f}%")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
