"""The packed kernels' real shape limits, learned by running them (each case in a forked child, so a
segfault fails one case, not the test run): every shape `packed_layout` accepts must compute the right
product, and the int8 shapes it refuses must still misbehave in torch (else the guard is too strict)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SWEEP = Path(__file__).with_name("kernel_sweep.py")


def _sweep(mode: str) -> list[dict]:
    out = subprocess.run([sys.executable, str(SWEEP), mode], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_every_shape_the_guard_allows_runs_correctly():
    results = _sweep("allowed")
    layouts = {r["layout"] for r in results}
    assert layouts == {"int4pack", "int8pack", "int8 as two int4 planes"}, layouts
    bad = [r for r in results if r["outcome"] != "ok"]
    assert not bad, f"packed kernels misbehave on shapes the guard allows: {bad[:8]}"


@pytest.mark.slow
def test_the_int8_shapes_the_guard_refuses_really_misbehave():
    """Which refused shapes break depends on the CPU kernel torch dispatches to: with AVX-512 every
    in_features that is not a multiple of 16; with AVX2 (8 lanes) only those not a multiple of 8. The
    guard refuses the union, so a model runs alike everywhere; this test notices torch fixing either."""
    results = _sweep("refused")
    dims = {r["case"][3] for r in results}
    assert dims == {8, 12, 14, 24, 33, 40}, dims
    capability = torch.backends.cpu.get_cpu_capability()
    must_fail = dims if capability.startswith("AVX512") else {d for d in dims if d % 8}
    still_bad = {r["case"][3] for r in results if r["outcome"] != "ok"}
    fixed = sorted(must_fail - still_bad)
    assert not fixed, (f"torch {torch.__version__}'s int8pack now handles in_features {fixed} "
                       f"on {capability}: relax the guard in packed_layout")


def test_int8_per_channel_on_24_inputs_falls_back_instead_of_crashing(monkeypatch):
    """The reported case: nn.Linear(24, 24) at 8 bits per channel crashed for 2 or 4 rows."""
    from cs336_inference.quantization import QuantizedLinear, kernels

    monkeypatch.setattr(kernels, "_announced", set())

    linear = torch.nn.Linear(24, 24, bias=False)
    with pytest.warns(UserWarning, match="in_features % 16"):
        layer = QuantizedLinear.from_linear(linear, bits=8, group_size=None, symmetric=True)
    assert layer.packed_weight() is None
    for rows in (1, 2, 3, 4):
        x = torch.randn(rows, 24)
        torch.testing.assert_close(layer(x), x @ layer.dequantized_weight().T)
