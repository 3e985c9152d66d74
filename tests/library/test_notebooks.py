"""Notebooks: the .py (jupytext percent) is the source, the committed .ipynb must match it and carry
no outputs; the code is plain Python (so `python NN_topic.py` runs what the kernel runs); each notebook
runs top to bottom on the CPU in a real Jupyter kernel (nbclient on the .ipynb, slow); each ends with a
summary and exercises."""

import os
import re
from pathlib import Path

import jupytext
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))
ANSWERS = sorted((NOTEBOOKS / "answers").glob("[0-9][0-9]_*.py"))   # worked answers to the exercises
WITH_ANSWERS = SOURCES   # every notebook has an answers notebook
ALL, ALL_IDS = SOURCES + ANSWERS, [s.stem for s in SOURCES] + [f"answers/{s.stem}" for s in ANSWERS]


def _cells(nb):
    return [(c.cell_type, c.source.strip()) for c in nb.cells]


@pytest.mark.parametrize("source", ALL, ids=ALL_IDS)
def test_ipynb_pair_in_sync_and_without_outputs(source):
    ipynb = source.with_suffix(".ipynb")
    assert ipynb.exists(), f"{ipynb.name} missing: run `jupytext --to ipynb {source.name}` in notebooks/"
    py_nb, ip_nb = jupytext.read(source), jupytext.read(ipynb)
    assert _cells(py_nb) == _cells(ip_nb), (
        f"{ipynb.name} is out of sync with {source.name}: run `jupytext --to ipynb {source.name}`")
    for cell in ip_nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs"), f"{ipynb.name} has outputs committed; clear them"


@pytest.mark.parametrize("source", ALL, ids=ALL_IDS)
def test_notebook_is_plain_python(source):
    """`python notebooks/NN_topic.py` runs the same code as the kernel (the slow test below) only if no
    cell needs IPython: no magics, shell escapes or get_ipython/display (jupytext would comment a magic
    out of the .py, so the script would silently skip it)."""
    for cell in jupytext.read(source).cells:
        if cell.cell_type != "code":
            continue
        for line in cell.source.splitlines():
            stripped = line.lstrip()
            assert not stripped.startswith(("%", "!")), f"{source.name}: IPython-only line {line!r}"
            assert "get_ipython" not in line and "display(" not in line, f"{source.name}: {line!r} needs IPython"
    compile(source.read_text(), str(source), "exec")


@pytest.mark.parametrize("source", SOURCES, ids=[s.stem for s in SOURCES])
def test_notebook_ends_with_a_summary_and_exercises_that_use_the_library(source):
    cells = jupytext.read(source).cells
    markdown = [c.source for c in cells if c.cell_type == "markdown"]
    headings = [line for m in markdown for line in m.splitlines() if line.startswith("## ")]
    ends = headings[-2:]
    assert len(ends) == 2 and re.fullmatch(r"## (\d+\. )?Summary", ends[0]) and ends[1] == "## Exercises", (
        f"{source.name} ends with {ends}")
    exercises = markdown[-1]
    numbered = [line for line in exercises.splitlines() if re.match(r"\d+\. ", line)]
    assert 2 <= len(numbered) <= 3, f"{source.name}: {len(numbered)} exercises"
    assert "`" in exercises and "tests/library/test_notebook_exercises.py" in exercises, (
        f"{source.name}: exercises should name the library calls they use and where the answers live")


@pytest.mark.parametrize("source", WITH_ANSWERS, ids=[s.stem for s in WITH_ANSWERS])
def test_every_exercise_has_a_worked_answer(source):
    """notebooks/answers/NN_topic.py answers each numbered exercise under `## Exercise k` (in order), and the
    notebook's exercises point there. tests/library/test_notebook_exercises.py runs and checks the answers."""
    answers = NOTEBOOKS / "answers" / source.name
    assert answers.exists(), f"{source.name}: no worked answers (write notebooks/answers/{source.name})"
    exercises = [c.source for c in jupytext.read(source).cells if c.cell_type == "markdown"][-1]
    numbered = [line for line in exercises.splitlines() if re.match(r"\d+\. ", line)]
    assert f"answers/{source.stem}.ipynb" in exercises, f"{source.name}: the exercises do not point to their answers"
    headings = [line for c in jupytext.read(answers).cells if c.cell_type == "markdown"
                for line in c.source.splitlines() if line.startswith("## Exercise")]
    assert [h.split(":")[0] for h in headings] == [f"## Exercise {k}" for k in range(1, len(numbered) + 1)], headings
    code = [c for c in jupytext.read(answers).cells if c.cell_type == "code"]
    assert len(code) > len(numbered), f"{answers.name}: a code cell per answer, after the setup"


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
