"""The executable lecture (the README's main job) runs end to end through the CLI, its assertions
hold, and it leaves the git tree as it was."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_lecture_runs_end_to_end(git_tree_unchanged):
    env = {k: v for k, v in os.environ.items() if k != "CS336_FIGURES"}   # the default output folders
    env.update(MPLBACKEND="Agg", PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "cs336_inference", "lecture"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"lecture failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    for section in ("landscape", "reduce_kv_cache_size", "quantization", "summary"):
        assert section in proc.stdout
