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
BENCHMARKS = ROOT / "src" / "cs336_inference" / "workshop" / "benchmarks"


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
    from cs336_inference.workshop.benchmarks.accounting import bench_accounting
    bench_accounting(quick=True)
    committed = sorted(p.name for p in (checkout / "figures").iterdir())
    assert committed == ["scratch"], committed
    written = sorted(p.name for p in (checkout / "figures" / "scratch").iterdir())
    assert written and all("_quick." in name for name in written), written


def test_benchmarks_write_only_through_the_scaffold():
    """Every write in benchmarks/ goes through `benchmarks.base` (which routes --quick and partial runs
    to the scratch folder): no module saves a figure or JSON of its own."""
    offenders = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        if path.name == "base.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            via_run = isinstance(func, ast.Attribute) and getattr(func.value, "id", None) == "run"
            if name in ("save_json", "save_figure", "savefig", "result_path") and not via_run:
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, f"writes outside benchmarks/base.py: {offenders}"


def test_figures_redraws_every_committed_plot_from_its_json(tmp_path, monkeypatch):
    """`python -m cs336_inference figures` redraws from the committed JSON alone (so a schema change
    that breaks a plot fails here), to the committed PNG names. Rendering the pixels is skipped."""
    from cs336_inference import cli
    from cs336_inference.workshop.benchmarks import base

    drawn = []
    monkeypatch.setattr(base, "save_figure", lambda fig, name, **kw: drawn.append(f"{name}.png") or Path(name))
    monkeypatch.setattr(base, "load_result", lambda name: json.loads((ROOT / "figures" / f"{name}.json").read_text())
                        if (ROOT / "figures" / f"{name}.json").exists() else None)
    assert cli.main(["figures"]) == 0
    committed = {p.name for p in (ROOT / "figures").glob("*.png")}
    live = {"serving.png", "serving_memory.png", "serving_smollm2.png"}   # drawn from live engine runs
    assert len(drawn) == len(set(drawn)) and set(drawn) == committed - live, sorted(set(drawn) ^ (committed - live))
    plt.close("all")


def test_the_scratch_folder_is_ignored_by_git():
    proc = subprocess.run(["git", "check-ignore", "-q", "figures/scratch/any.png"], cwd=ROOT)
    if proc.returncode == 128:
        pytest.skip("not a git checkout")
    assert proc.returncode == 0, "figures/scratch/ must be listed in .gitignore"
