"""The autograder itself (not graded): retargeting, the skeleton, results.json in Gradescope's structure,
hidden tests, points, and the mutation check's bookkeeping. Grading runs go through pytest in a fresh
process, exactly as course staff run them."""

import ast
import contextlib
import inspect
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from cs336_inference.homework import GRADED, graded_names, skeleton

ROOT = Path(__file__).resolve().parents[2]
GRADED_DIR = ROOT / "tests" / "graded"

# Gradescope's results.json, from https://gradescope-autograders.readthedocs.io/en/latest/specs/ ("Output
# format"): a top-level score (required unless every test has one), optional execution_time, output,
# visibility, stdout_visibility, extra_data, and tests, each with optional score, max_score, status, name,
# number, output, tags, visibility, extra_data. Visibility is one of four values; status passed/failed.
VISIBILITY = {"enum": ["hidden", "after_due_date", "after_published", "visible"]}
GRADESCOPE_SCHEMA = {
    "type": "object",
    "properties": {
        "score": {"type": "number"},
        "execution_time": {"type": "number"},
        "output": {"type": "string"},
        "output_format": {"enum": ["text", "html", "simple_format", "md", "ansi"]},
        "visibility": VISIBILITY,
        "stdout_visibility": VISIBILITY,
        "extra_data": {"type": "object"},
        "tests": {"type": "array", "items": {
            "type": "object",
            "properties": {
                "score": {"type": "number"}, "max_score": {"type": "number"},
                "status": {"enum": ["passed", "failed"]}, "name": {"type": "string"},
                "number": {"type": "string"}, "output": {"type": "string"},
                "tags": {"type": "array", "items": {"type": "string"}}, "visibility": VISIBILITY,
                "extra_data": {"type": "object"},
            },
            "additionalProperties": False,
        }},
        "leaderboard": {"type": "array"},
    },
    "additionalProperties": False,
    "anyOf": [{"required": ["score"]}, {"properties": {"tests": {"items": {"required": ["score"]}}}}],
}


def grade(*args, env=None):
    """pytest ARGS -> (exit code, output), run in this process as course staff would run it from a shell
    (a fresh interpreter per run costs ~5 s of imports; the implementation choice is restored after)."""
    import implementation
    before, saved = implementation._spec, {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = pytest.main(["-q", "-s", "-p", "no:cacheprovider", "-p", "no:unraisableexception", *map(str, args)])
    finally:
        implementation.select(before)
        for key, value in saved.items():
            os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
    return int(code), out.getvalue()


HIDDEN_TESTS = '''
import pytest
from adapters import run_get_batch
import torch


@pytest.mark.points(3)
def test_hidden_passes():
    assert torch.initial_seed() == 0      # seeded like every test of the suite
    x, y = run_get_batch(torch.arange(20), 2, 4)
    assert x.shape == (2, 4)


@pytest.mark.visibility("hidden")
@pytest.mark.parametrize("n", [1, 2])
def test_hidden_fails(n):
    assert n == 1, "only the first case passes"


def test_hidden_skipped():
    pytest.skip("needs a GPU")
'''


def test_results_json_has_gradescopes_structure_points_and_hidden_tests(tmp_path):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "test_staff_only.py").write_text(HIDDEN_TESTS)
    out = tmp_path / "results.json"
    rc, log = grade(GRADED_DIR / "test_batch_sampler.py", "--hidden-tests", hidden, "--grade-json", out)
    assert rc == 1, log                                       # one hidden case fails
    results = json.loads(out.read_text())
    jsonschema.validate(results, GRADESCOPE_SCHEMA)
    tests = {t["name"]: t for t in results["tests"]}
    from grading import load_points
    sampler_points = [v for k, v in load_points().items() if k.startswith("test_batch_sampler.py::")]
    assert sum(t["max_score"] for n, t in tests.items() if n.startswith("test_batch_sampler.py")) == \
        pytest.approx(sum(sampler_points))
    assert tests["test_staff_only.py::test_hidden_passes"]["max_score"] == 3.0
    assert tests["test_staff_only.py::test_hidden_passes"]["visibility"] == "after_due_date"
    assert tests["test_staff_only.py::test_hidden_fails[1]"] | {"output": ""} == {
        "name": "test_staff_only.py::test_hidden_fails[1]", "score": 0.5, "max_score": 0.5, "status": "passed",
        "output": "", "visibility": "hidden"}                # 1 default point shared by two cases
    failed = tests["test_staff_only.py::test_hidden_fails[2]"]
    assert failed["score"] == 0 and failed["status"] == "failed" and "only the first case passes" in failed["output"]
    assert "test_staff_only.py::test_hidden_skipped" not in tests   # a test that cannot run here counts for nothing
    assert results["score"] == pytest.approx(sum(t["score"] for t in results["tests"]))
    assert results["score"] == pytest.approx(sum(sampler_points) + 3 + 0.5)
    assert f"{results['score']:.2f} / {sum(sampler_points) + 4:.2f} points" in results["output"]
    assert "PASS" in log and results["output"] in log         # per-test points and the summary line are printed


def test_the_skeleton_graded_with_the_printed_command_from_another_folder_scores_zero(tmp_path):
    """`homework init` prints the command that grades the package; run as printed (plus --grade-json), from a
    folder that is neither the checkout nor the package's, it grades: 0 points, each graded function named
    "not implemented", the score on the last line."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    init = subprocess.run([sys.executable, "-m", "cs336_inference", "homework", "init", "my_solution"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert init.returncode == 0, init.stderr
    command = init.stdout.strip().splitlines()[-1].split(": ", 1)[1]
    assert str(tmp_path / "my_solution") in command and f"cd {ROOT}" in command, command
    assert command in (tmp_path / "my_solution" / "README.md").read_text()
    out = tmp_path / "results" / "results.json"
    proc = subprocess.run(f"{command} --grade-json {out} -p no:cacheprovider", shell=True, cwd=elsewhere,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]   # test failures, not a crash
    results = json.loads(out.read_text())
    jsonschema.validate(results, GRADESCOPE_SCHEMA)
    assert results["score"] == 0 and all(t["status"] == "failed" for t in results["tests"])
    names = set()
    for t in results["tests"]:
        assert t["output"].startswith("[call] not implemented: ") and "\n" not in t["output"], t
        names.add(t["output"].removeprefix("[call] not implemented: ").split(".")[0])
    assert names == set(graded_names()), "every graded function must fail some test as not implemented"
    assert f"not implemented: {', '.join(sorted(graded_names()))}" in results["output"]
    from grading import load_points
    last = proc.stdout.strip().splitlines()[-1]
    assert last == results["output"] and f"0.00 / {sum(load_points().values()):.2f} points" in last, last


def test_the_grading_page_states_the_points_that_points_py_gives():
    """docs/grading.md's sentence about the graded suite's points, its example summary line and the reference's
    score carry the total of tests/graded/points.py (the one source)."""
    from grading import load_points
    total = sum(load_points().values())
    text = (ROOT / "docs" / "grading.md").read_text()
    stated = re.findall(r"`tests/graded/points\.py`,\s*(\d+(?:\.\d+)?) in all", text)
    examples = re.findall(r"graded my_solution: [\d.]+ / (\d+(?:\.\d+)?) points", text)
    reference = re.findall(r"The reference scores (\d+(?:\.\d+)?)", text)
    assert stated, "docs/grading.md must say '(weights: `tests/graded/points.py`, N in all; ...' with N the total"
    assert examples and reference, "docs/grading.md must show a summary line and the reference's score"
    numbers = stated + examples + reference
    assert [float(n) for n in numbers] == [total] * len(numbers), \
        f"docs/grading.md states {numbers} points; tests/graded/points.py totals {total:g}"


def test_a_missing_function_fails_only_its_own_tests_and_the_env_var_selects_the_package(tmp_path):
    partial = tmp_path / "partial_solution.py"
    partial.write_text("from cs336_inference.homework.reference import *  # noqa\n"
                       "from cs336_inference.homework.reference import RollingKVCache  # noqa\n"
                       "del get_batch\n")
    out = tmp_path / "results.json"
    rc, log = grade(GRADED_DIR / "test_batch_sampler.py", GRADED_DIR / "test_rolling_buffer.py",
                    "--grade-json", out, env={"CS336_INFERENCE_IMPL": str(partial)})
    assert rc == 1, log[-3000:]
    tests = json.loads(out.read_text())["tests"]
    for t in tests:
        if t["name"].startswith("test_batch_sampler.py"):
            assert t["status"] == "failed" and "not implemented: get_batch" in t["output"], t
        else:
            assert t["status"] == "passed", t                 # never a fallback, never collateral damage


def test_a_package_written_to_the_old_skeleton_is_graded_under_the_former_names(tmp_path):
    """registry.FORMER_NAMES: a student's `RollingKVBuffer` (now `RollingKVCache`) is still found, in the sandbox."""
    old = tmp_path / "old_skeleton_solution.py"
    old.write_text("from cs336_inference.homework.reference import *  # noqa\n"
                   "from cs336_inference.homework.reference import RollingKVCache as RollingKVBuffer  # noqa\n"
                   "del RollingKVCache\n")
    out = tmp_path / "results.json"
    rc, log = grade(GRADED_DIR / "test_rolling_buffer.py", "--grade-json", out, env={"CS336_INFERENCE_IMPL": str(old)})
    assert rc == 0, log[-3000:]
    assert all(t["status"] == "passed" for t in json.loads(out.read_text())["tests"])


def test_an_unimportable_package_fails_every_graded_test_without_crashing_the_run(tmp_path):
    broken = tmp_path / "broken_solution.py"
    broken.write_text("def logits_to_probs(:\n")
    out = tmp_path / "results.json"
    rc, log = grade(GRADED_DIR / "test_batch_sampler.py", "--impl", broken, "--grade-json", out)
    assert rc == 1, log[-3000:]
    results = json.loads(out.read_text())
    assert results["score"] == 0
    assert all("cannot import the implementation" in t["output"] and "SyntaxError" in t["output"]
               for t in results["tests"])
    assert log.count("SyntaxError") == 2, log[-3000:]           # once loudly, once on the last line: no test ran


def test_a_module_name_that_is_not_importable_is_reported_once_with_what_impl_takes(tmp_path):
    out = tmp_path / "results.json"
    rc, log = grade(GRADED_DIR / "test_batch_sampler.py", "--impl", "no_such_solution", "--grade-json", out)
    assert rc == 1, log[-3000:]
    last = log.strip().splitlines()[-1]
    assert "0.00 / " in last and "cannot import the implementation no_such_solution: ModuleNotFoundError" in last
    assert "--impl takes the path of a package folder" in last and log.count("ModuleNotFoundError") == 2, log[-3000:]
    assert json.loads(out.read_text())["score"] == 0


def test_every_graded_test_has_points_and_every_points_entry_is_a_graded_test():
    from grading import load_points
    tests = {f"{path.name}::{node.name}" for path in GRADED_DIR.glob("test_*.py")
             for node in ast.parse(path.read_text()).body
             if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    points = load_points()
    assert set(points) == tests, {"without points": sorted(tests - set(points)), "stale": sorted(set(points) - tests)}
    assert all(isinstance(v, (int, float)) and v > 0 for v in points.values())


def test_one_adapter_per_graded_name_and_the_skeleton_matches_the_reference(tmp_path):
    import adapters
    source = inspect.getsource(adapters)
    graded_block = source.split("# === graded adapters")[1].split("\n", 1)[1].split("# === library helpers")[0]
    called = [node.args[0].value for node in ast.walk(ast.parse(graded_block))
              if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_graded"]
    assert sorted(called) == sorted(graded_names()), "each graded name needs exactly one adapter"
    defined = [n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)]
    assert len(defined) == len(set(defined)), f"duplicate adapters: {[d for d in defined if defined.count(d) > 1]}"
    # the generated package: same names, same signatures, docstrings with the lecture's shapes
    skeleton.write_skeleton(tmp_path / "student")
    sys.path.insert(0, str(tmp_path))
    try:
        import student
        for name, entry in GRADED.items():
            mine = getattr(student, name)
            assert (inspect.getdoc(mine) or "") == inspect.getdoc(entry.obj), name
            members = [("", entry.obj, mine)] if entry.kind == "function" else [
                (attr, getattr(entry.obj, attr), getattr(mine, attr)) for attr in vars(entry.obj)
                if inspect.isfunction(getattr(entry.obj, attr)) and (attr == "__init__" or not attr.startswith("_"))]
            for attr, ref, gen in members:
                assert inspect.signature(ref) == inspect.signature(gen), f"{name}.{attr}"
                assert "NotImplementedError" in inspect.getsource(gen)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("student", None)


def test_homework_init_refuses_to_overwrite_and_bad_names(tmp_path):
    from cs336_inference import cli
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "sampling.py").write_text("my work")
    assert cli.main(["homework", "init", str(tmp_path / "taken")]) == 2
    assert (tmp_path / "taken" / "sampling.py").read_text() == "my work"
    assert cli.main(["homework", "init", str(tmp_path / "not-a-name")]) == 2
    assert not (tmp_path / "not-a-name").exists()


def test_every_mutant_applies_to_the_current_source():
    """The mutation check plants each bug by text replacement; a refactor that moves the code must update
    tests/mutation/mutants.py (run.py would stop), so check here, fast, on every run."""
    sys.path.insert(0, str(ROOT / "tests" / "mutation"))
    try:
        from mutants import MUTANTS
    finally:
        sys.path.pop(0)
    names = [m.name for m in MUTANTS]
    assert len(names) == len(set(names))
    assert sum(1 for m in MUTANTS if m.issue) == 12 and {m.issue for m in MUTANTS if m.issue} == set(range(1, 13))
    assert sum(1 for m in MUTANTS if not m.issue and not m.equivalent) >= 10
    for m in MUTANTS:
        text = (ROOT / "src" / "cs336_inference" / m.path).read_text()
        for old, _ in m.edits:
            assert text.count(old) == 1, f"{m.name}: {old!r} occurs {text.count(old)} times in {m.path}"


@pytest.mark.slow
@pytest.mark.parametrize("shard", [0, 1])
def test_mutation_check_kills_every_non_equivalent_mutant(tmp_path, shard):
    """The full mutation check as two interleaved shards, one per test (so the two pytest-xdist workers each run
    one, not one worker two): controls (reference copy 100%, skeleton 0) in shard 0, every graded mutant of the
    shard killed by the graded suite, every library stub of the shard caught by its library tests."""
    out = tmp_path / "mutation.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "mutation" / "run.py"), "--json", str(out),
                           "--shard", f"{shard}/2"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-6000:]
    report = json.loads(out.read_text())
    sys.path.insert(0, str(ROOT / "tests" / "mutation"))
    try:
        from mutants import MUTANTS
    finally:
        sys.path.pop(0)
    assert [m["name"] for m in report["mutants"]] == [m.name for m in MUTANTS[shard::2]]
    mutants = [m for m in report["mutants"] if not m["equivalent"]]
    score = sum(m["killed"] for m in mutants) / len(mutants)
    survivors = [m["name"] for m in mutants if not m["killed"]]
    assert score >= 0.95, f"mutation score {score:.3f} < 0.95; survivors: {survivors}"
    if shard == 0:
        assert report["controls"]["unmodified_copy"]["failed"] == []
    assert report["library_stubs"] and all(s["killed"] for s in report["library_stubs"])
