"""Notebooks: the .py (jupytext percent) is the source, the committed .ipynb must match it and carry
no outputs; each notebook runs top to bottom on the CPU, as a script and in a real Jupyter kernel
(nbclient on the .ipynb) (slow); each ends with a summary and exercises."""

import os
import subprocess
import sys
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parents[1]

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def _cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


@pytest.mark.parametrize("source", SOURCES, ids=[s.stem for s in SOURCES])
def test_ipynb_pair_in_sync_and_without_outputs(source):
    ipynb = source.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} missing: run `jupytext --to ipynb {source.name}` in notebooks/"
    py_nb, ip_nb = jupytext.read(source), jupytext.read(ipynb)
    assert _cells(py_nb) == _cells(ip_nb), (
        f"{ipynb.name} is out of sync with {source.name}: run `jupytext --to ipynb {source.name}`")
    for cell in ip_nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs"), f"{ipynb.name} has outputs committed; clear them"


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES, ids=[s.stem for s in SOURCES])
def test_notebook_runs_top_to_bottom_without_touching_the_git_tree(source, git_tree_unchanged):
    env = {k: v for k, v in os.environ.items() if k != "CS336_FIGURES"}   # the default output folders
    env["MPLBACKEND"] = "Agg"
    src = str(Path(__file__).resolve().parents[1] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, source.name], cwd=NOTEBOOKS, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{source.name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


@pytest.mark.parametrize("source", SOURCES, ids=[s.stem for s in SOURCES])
def test_notebook_ends_with_a_summary_and_exercises_that_use_the_library(source):
    cells = jupytext.read(source).cells
    markdown = [c.source for c in cells if c.cell_type == "markdown"]
    headings = [line for m in markdown for line in m.splitlines() if line.startswith("## ")]
    assert headings[-2:] == ["## Summary", "## Exercises"], f"{source.name} ends with {headings[-2:]}"
    exercises = markdown[-1]
    numbered = [line for line in exercises.splitlines() if line[:3] in ("1. ", "2. ", "3. ")]
    assert 2 <= len(numbered) <= 3, f"{source.name}: {len(numbered)} exercises"
    assert "`" in exercises and "tests/test_notebook_exercises.py" in exercises, (
        f"{source.name}: exercises should name the library calls they use and where the answers live")


@pytest.mark.slow
@pytest.mark.parametrize("source", SOURCES, ids=[s.stem for s in SOURCES])
def test_notebook_runs_in_a_jupyter_kernel(source, git_tree_unchanged, monkeypatch):
    """The committed .ipynb, executed by nbclient in the python3 kernel (ipykernel), from notebooks/."""
    nbclient = pytest.importorskip("nbclient", reason="pip install -e '.[dev]' (nbclient, ipykernel)")
    import nbformat

    monkeypatch.delenv("CS336_FIGURES", raising=False)      # the default output folders (git-ignored scratch)
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    nb = nbformat.read(source.with_suffix(".ipynb"), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "device:" in printed
