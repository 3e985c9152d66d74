"""Where outputs go: full benchmark runs write the committed figures/, quick runs, notebooks and the
lecture a git-ignored scratch folder, so they never rewrite a committed result.

Not graded (the library's own output plumbing)."""

import ast
import json
import subprocess
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from cs336_inference import figures

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "src" / "cs336_inference" / "benchmarks"


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """A fake checkout root, with CS336_FIGURES unset, so the default folders are exercised."""
    monkeypatch.delenv("CS336_FIGURES", raising=False)
    monkeypatch.setattr(figures, "_repo_root", lambda: tmp_path)
    return tmp_path


def test_only_full_benchmark_runs_write_the_committed_folder(checkout):
    fig = plt.figure()
    assert figures.save_figure(fig, "notebook_plot") == checkout / "figures" / "scratch" / "notebook_plot.png"
    assert figures.save_json({}, "r", result=True, quick=True) == checkout / "figures" / "scratch" / "r_quick.json"
    assert figures.save_json({"a": 1}, "r", result=True) == checkout / "figures" / "r.json"
    plt.close(fig)
    assert json.loads((checkout / "figures" / "r.json").read_text()) == {"a": 1}


def test_load_result_reads_only_committed_results(checkout):
    assert figures.load_result("r") is None                      # nothing committed yet
    figures.save_json({"a": 1}, "r", quick=True)                  # a scratch run is not a result
    assert figures.load_result("r") is None
    (checkout / "figures" / "r.json").write_text('{"a": 2}')
    assert figures.load_result("r") == {"a": 2}


def test_a_quick_benchmark_leaves_the_committed_folder_alone(checkout):
    from cs336_inference.benchmarks.accounting import bench_accounting
    bench_accounting(quick=True)
    committed = sorted(p.name for p in (checkout / "figures").iterdir())
    assert committed == ["scratch"], committed
    written = sorted(p.name for p in (checkout / "figures" / "scratch").iterdir())
    assert written and all("_quick." in name for name in written), written


def test_every_benchmark_passes_quick_to_every_write():
    """Each save_figure/save_json call in benchmarks/ is a result write that honours --quick."""
    offenders = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("save_figure", "save_json"):
                keywords = {k.arg for k in node.keywords}
                if not {"result", "quick"} <= keywords:
                    offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, f"writes that ignore --quick: {offenders}"


def test_the_scratch_folder_is_ignored_by_git():
    proc = subprocess.run(["git", "check-ignore", "-q", "figures/scratch/any.png"], cwd=ROOT)
    if proc.returncode == 128:
        pytest.skip("not a git checkout")
    assert proc.returncode == 0, "figures/scratch/ must be listed in .gitignore"
