"""The executable lecture (the README's main job) runs end to end and its assertions hold."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_lecture_runs_end_to_end(tmp_path):
    env = {**os.environ, "MPLBACKEND": "Agg", "CS336_FIGURES": str(tmp_path),
           "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(ROOT / "lecture" / "lecture_10.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"lecture failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    for section in ("landscape", "reduce_kv_cache_size", "quantization", "summary"):
        assert section in proc.stdout
