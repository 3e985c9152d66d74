"""Notebooks: the .py (jupytext percent) is the source, the committed .ipynb must match it and carry
no outputs; each notebook runs top to bottom on the CPU (slow)."""

import os
import subprocess
import sys
from pathlib import Path

import jupytext
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
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
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = src + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, source.name], cwd=NOTEBOOKS, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{source.name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
