"""The CPU thread policy, read back from the CLI path (`python -m cs336_inference info`) in fresh
processes: OpenMP's wait policy must be set before torch loads, so only a new process shows it.

Not graded (the library's own runtime setup)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cs336_inference import device

SRC = Path(__file__).resolve().parents[2] / "src"


def _info(*args, **env) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS",
                                                              "CS336_NUM_THREADS", "GOMP_SPINCOUNT")}
    clean["PYTHONPATH"] = str(SRC) + os.pathsep + clean.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-m", "cs336_inference", "info", *args], env={**clean, **env},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return dict(line.split(": ", 1) for line in out.splitlines())


def test_the_cli_applies_passive_waiting_and_one_thread_for_small_work():
    info = _info()
    assert info["omp_wait_policy"] == "PASSIVE"
    assert info["gomp_spincount"] == "300000"            # a spin, then sleep (see openmp)
    assert info["torch_threads"] == "1" == info["policy_small"]
    assert int(info["policy_large"]) >= 1


def test_explicit_settings_win():
    info = _info("--parallel", CS336_NUM_THREADS="2", OMP_WAIT_POLICY="active")
    assert info["omp_wait_policy"] == "ACTIVE"
    assert info["gomp_spincount"] == "default"           # an explicit ACTIVE keeps OpenMP's own spin
    assert _info(GOMP_SPINCOUNT="500")["gomp_spincount"] == "500"
    assert info["torch_threads"] == "2" == info["policy_small"] == info["policy_large"]


def test_thread_counts_from_the_environment_are_checked(monkeypatch):
    monkeypatch.delenv("CS336_NUM_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert device.thread_policy(parallel=False) == 3
    monkeypatch.setenv("CS336_NUM_THREADS", "2")                  # the package's own variable wins
    assert device.thread_policy(parallel=True) == 2
    monkeypatch.setenv("CS336_NUM_THREADS", "two")
    with pytest.raises(ValueError, match="CS336_NUM_THREADS must be a positive int"):
        device.thread_policy()
    with pytest.raises(TypeError, match="parallel"):
        device.thread_policy(parallel=1)


def test_the_wait_policy_module_does_not_import_torch():
    """It must run before torch loads OpenMP; importing torch itself would make that impossible."""
    tree = ast.parse((SRC / "cs336_inference" / "workshop" / "openmp.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported <= {"__future__", "os", "sys"}, imported


@pytest.mark.slow
def test_bench_thread_policy_runs_each_policy_in_its_own_process(tmp_path, monkeypatch):
    """Smoke run of two policies (each child process compiles a model: all four would double the time):
    each policy's process reports back the OpenMP settings it ran under; the others are left out."""
    from cs336_inference import figures
    from cs336_inference.workshop.benchmarks.thread_policy import POLICIES, bench_thread_policy

    monkeypatch.setattr(figures, "scratch_dir", lambda: tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with pytest.raises(ValueError, match="policies"):
        bench_thread_policy(quick=True, device="cpu", policies=("no such policy",))
    result = bench_thread_policy(quick=True, device="cpu", policies=("spin 300000, no switch", "spin forever"))
    assert set(result["policies"]) == {"spin 300000, no switch", "spin forever"} and len(POLICIES) == 6
    got = {name: (r["omp_wait_policy"], r["gomp_spincount"], r["switch"]) for name, r in result["policies"].items()}
    assert got["spin 300000, no switch"] == ("PASSIVE", "300000", False)
    assert got["spin forever"] == ("ACTIVE", "default", True)
    assert all(r["idle compiled"]["ms"] > 0 for r in result["policies"].values())
    assert (tmp_path / "thread_policy_quick.json").exists() and (tmp_path / "thread_policy_quick.png").exists()
