"""Where benchmarks, notebooks and the lecture write their outputs: `figures/` of the checkout.

Override with the CS336_FIGURES environment variable (e.g. in a read-only install).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib

matplotlib.use(os.environ.get("MPLBACKEND", "Agg"))  # files, never a window


def figures_dir() -> Path:
    if os.environ.get("CS336_FIGURES"):
        path = Path(os.environ["CS336_FIGURES"])
    else:
        repo = Path(__file__).resolve().parents[2]
        path = repo / "figures" if (repo / "pyproject.toml").exists() else Path.cwd() / "figures"
    path.mkdir(parents=True, exist_ok=True)
    return path


def save_figure(fig, name: str) -> Path:
    """Save a matplotlib figure as figures/<name>.png and return the path."""
    path = figures_dir() / f"{name}.png"
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path


def save_json(data, name: str) -> Path:
    """Write figures/<name>.json (sorted keys, indented) and return the path."""
    path = figures_dir() / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=float) + "\n")
    return path
