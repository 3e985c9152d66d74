"""Where outputs go: committed benchmark results in `figures/`, everything else in a scratch folder.

- `result=True, quick=False` (a full `bench NAME` run): `figures/NAME.json` / `.png` of the checkout,
  the committed results docs/benchmarks.md, the lecture and the notebooks quote.
- `result=True, quick=True` (a `--quick` smoke run): the scratch folder, as `NAME_quick.*`.
- anything else (notebooks, the lecture, ad-hoc plots): the scratch folder.
The scratch folder is `figures/scratch/` of the checkout (git-ignored), so running the notebooks, the
lecture or a quick benchmark never changes a committed file. Outside a checkout both are under
./figures. CS336_FIGURES=DIR sends every output to DIR (tests use a temporary folder; point it at
figures/ to regenerate committed figures from a notebook on purpose).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib

matplotlib.use(os.environ.get("MPLBACKEND", "Agg"))  # files, never a window


def _repo_root() -> Path | None:
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").exists() else None


def figures_dir() -> Path:
    """Where committed benchmark results live (and where full `bench` runs write)."""
    if os.environ.get("CS336_FIGURES"):
        path = Path(os.environ["CS336_FIGURES"])
    else:
        path = (_repo_root() or Path.cwd()) / "figures"
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_result(name: str) -> dict | None:
    """A committed benchmark result, figures/NAME.json, or None where this checkout has none (the lecture
    and notebooks read these instead of re-running a long benchmark)."""
    path = figures_dir() / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def scratch_dir() -> Path:
    """Where everything that is not a committed result goes (git-ignored in a checkout)."""
    if os.environ.get("CS336_FIGURES"):
        path = Path(os.environ["CS336_FIGURES"])
    else:
        path = (_repo_root() or Path.cwd()) / "figures" / "scratch"
    path.mkdir(parents=True, exist_ok=True)
    return path


def result_path(name: str, suffix: str, result: bool = False, quick: bool = False) -> Path:
    """The file a figure/JSON called `name` is written to (see the module docstring)."""
    if result and not quick:
        return figures_dir() / f"{name}{suffix}"
    return scratch_dir() / f"{name}{'_quick' if quick else ''}{suffix}"


def save_figure(fig, name: str, result: bool = False, quick: bool = False) -> Path:
    """Save a matplotlib figure as NAME.png (where: see the module docstring) and return the path."""
    path = result_path(name, ".png", result, quick)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def save_json(data, name: str, result: bool = False, quick: bool = False) -> Path:
    """Write NAME.json (sorted keys, indented; where: see the module docstring) and return the path."""
    path = result_path(name, ".json", result, quick)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=float) + "\n")
    return path
