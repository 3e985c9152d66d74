"""Two houses: the teaching core never reaches into the performance workshop, and kernels meet the model
through the core's two registries (attention, int4 linear).

- the imports of every core file (and the lecture), walked with `ast`: none names the workshop or a
  module that moved into it;
- a fresh process that imports the core: no workshop module loaded, the environment unchanged;
- the registries: register / look up / refuse, "cpu" attention only once the workshop registered it,
  "sdpa" against a softmax attention written here, and an int4 kernel registered here running a layer.
Not graded (the library's own layout).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from adapters import make_config, make_model
from cs336_inference.model.attention import ATTENTION, grouped_attention
from cs336_inference.model.kernel_registry import KernelRegistry
from cs336_inference.quantization import QuantizedLinear
from cs336_inference.quantization.kernels import LINEAR, Int4Kernel

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "src" / "cs336_inference"
CORE_PARTS = ("model", "generation", "serving", "accounting", "quantization", "compression", "homework", "data")
CORE_MODULES = ("device", "timing", "figures", "tables", "_checks")   # the core's top-level helpers
# What the workshop holds, under the names the modules had before they moved there.
WORKSHOP = ("cs336_inference.workshop", "cs336_inference._openmp", "cs336_inference.cpu_tuning",
            "cs336_inference.huge_pages", "cs336_inference.fast_path", "cs336_inference.startup",
            "cs336_inference.benchmarks", "cs336_inference.model.cpu_kernels", "cs336_inference.model.hf_peer",
            "cs336_inference.quantization.cpu_int4", "cs336_inference.quantization.dense_prefill")


def _core_files() -> list[Path]:
    files = [p for part in CORE_PARTS for p in sorted((PKG / part).rglob("*.py"))]
    files += [PKG / f"{name}.py" for name in CORE_MODULES]
    return files + sorted((ROOT / "lecture").glob("*.py"))


def _imported(path: Path) -> set[str]:
    """Every module `path` imports (function-level imports too), relative ones resolved; `from pkg import
    name` counts as pkg.name as well (name may be a submodule)."""
    in_package = PKG in path.parents
    package = ".".join(path.relative_to(PKG.parent).with_suffix("").parts[:-1]) if in_package else ""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in node.names)
    return found


def _is_workshop(module: str) -> bool:
    return any(module == w or module.startswith(w + ".") for w in WORKSHOP)


def test_the_walk_sees_relative_and_absolute_imports(tmp_path):
    """The checker itself: it resolves a relative import inside the package and reads function-level ones."""
    probe = PKG / "model" / "attention.py"
    assert "cs336_inference.model.kernel_registry" in _imported(probe)
    lecture = tmp_path / "lecture_probe.py"
    lecture.write_text("def f():\n    from cs336_inference.workshop import fast_path\n")
    assert any(_is_workshop(m) for m in _imported(lecture))
    assert not _is_workshop("cs336_inference.workshops_elsewhere") and _is_workshop("cs336_inference.benchmarks.x")


def test_the_core_and_the_lecture_import_nothing_from_the_workshop():
    files = _core_files()
    assert len(files) > 80 and all(p.exists() for p in files)   # the walk reads the real tree
    found = sorted(f"{p.relative_to(ROOT)} imports {m}" for p in files for m in _imported(p) if _is_workshop(m))
    assert not found, "the teaching core reaches into the workshop:\n  " + "\n  ".join(found)


def _fresh_python(code: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_importing_the_core_loads_no_workshop_module_and_leaves_the_environment_unchanged():
    result = _fresh_python(
        "import json, os, sys\n"
        "before = dict(os.environ)\n"
        "import cs336_inference\n"
        "torch_at_import = 'torch' in sys.modules\n"
        "import cs336_inference.model, cs336_inference.generation, cs336_inference.serving\n"
        "import cs336_inference.accounting, cs336_inference.quantization, cs336_inference.compression\n"
        "from cs336_inference import TransformerLM, generate, load_pretrained\n"
        "changed = {k: [before.get(k), os.environ.get(k)] for k in set(before) | set(os.environ)\n"
        "           if before.get(k) != os.environ.get(k)}\n"
        "print(json.dumps({'changed': changed, 'torch_at_import': torch_at_import,\n"
        "                  'workshop': sorted(m for m in sys.modules if m.startswith('cs336_inference.workshop'))}))")
    assert result == {"changed": {}, "torch_at_import": False, "workshop": []}


def test_the_cli_entry_applies_the_openmp_policy_before_torch():
    """`python -m cs336_inference` is where the policy is set (workshop/openmp.py): in the environment, and
    only where it is unset; the package itself set nothing (checked above)."""
    from cs336_inference.workshop.openmp import apply_wait_policy

    env: dict[str, str] = {}
    assert apply_wait_policy(env) == {} and env == {}   # torch is loaded in this process: too late, nothing set
    result = _fresh_python(
        "import json, os\n"
        "from cs336_inference.workshop.openmp import apply_wait_policy\n"
        "mine = {'OMP_WAIT_POLICY': 'active'}\n"
        "print(json.dumps({'set': apply_wait_policy(), 'again': apply_wait_policy(),\n"
        "                  'env': [os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT')],\n"
        "                  'explicit': [apply_wait_policy(mine), mine]}))")
    assert result["set"] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "300000"} == dict(zip(
        ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"), result["env"]))
    assert result["again"] == {}                                                    # never overrides
    assert result["explicit"] == [{}, {"OMP_WAIT_POLICY": "active"}]                 # ACTIVE keeps its own spin


# --- the registries ---------------------------------------------------------------------------------------


def test_a_registry_registers_looks_up_and_refuses_clearly():
    reg = KernelRegistry("toy kernel", workshop=("fast",))
    slow = reg.register("slow", lambda x: x + 1)
    assert reg.get("slow") is slow and reg.names() == ("slow",) and "slow" in reg and reg.check("slow") == "slow"
    assert reg.register("slow", slow) is slow                                       # the same again: a no-op
    with pytest.raises(ValueError, match="'slow' is registered already"):
        reg.register("slow", lambda x: x)
    assert reg.get("slow") is slow                                                  # unchanged by the refusal
    with pytest.raises(ValueError, match=r"toy kernel must be one of the registered \('slow',\), got 'slo'"):
        reg.get("slo")
    with pytest.raises(ValueError, match=r"got 'fast' \('fast': the performance workshop registers it: call "
                                         r"`cs336_inference.workshop.register_kernels\(\)` first\)"):
        reg.check("fast")
    with pytest.raises(TypeError, match="toy kernel must be a str"):
        reg.check(3)
    with pytest.raises(TypeError, match="non-empty str"):
        reg.register("", slow)
    reg.register("fast", abs, why_unavailable=lambda: "no such CPU here")
    with pytest.raises(ValueError, match=r"'fast' cannot run here: no such CPU here; use one of \('slow',\)"):
        reg.get("fast")
    reg.register("fast", round, replace=True)                                       # replaced, now always runs
    assert reg.get("fast") is round and reg.why_unavailable("fast") is None
    reg.unregister("fast")
    assert reg.names() == ("slow",)
    with pytest.raises(ValueError, match="must be one of the registered"):
        reg.unregister("fast")


def test_the_core_registers_reference_and_sdpa_and_the_workshop_adds_cpu():
    result = _fresh_python(
        "import json\n"
        "import cs336_inference\n"
        "from cs336_inference.model.attention import ATTENTION\n"
        "from cs336_inference.quantization.kernels import LINEAR\n"
        "from cs336_inference import ModelConfig, TransformerLM\n"
        "model = TransformerLM(ModelConfig(vocab_size=32, context_length=16, d_model=32, num_layers=1,\n"
        "                                  num_heads=2, num_kv_heads=1, d_ff=64))\n"
        "before = [list(ATTENTION.names()), list(LINEAR.names())]\n"
        "try:\n"
        "    model.set_attention_kernel('cpu'); error = None\n"
        "except ValueError as e:\n"
        "    error = str(e)\n"
        "from cs336_inference import workshop\n"
        "said = workshop.register_kernels()\n"
        "print(json.dumps({'before': before, 'error': error, 'said': said,\n"
        "                  'after': [list(ATTENTION.names()), list(LINEAR.names())]}))")
    assert result["before"] == [["reference", "sdpa"], ["torch"]]
    assert "('reference', 'sdpa')" in result["error"] and "got 'cpu'" in result["error"]
    assert "cs336_inference.workshop.register_kernels()" in result["error"]
    assert result["said"] == {"attention": "cpu", "int4 linear": "cs336 avx512-bf16"}
    assert result["after"] == [["reference", "sdpa", "cpu"], ["torch", "cs336 avx512-bf16"]]


def test_a_misspelt_attention_kernel_is_refused_naming_the_registered_ones():
    model = make_model(make_config(vocab_size=32, context_length=16, d_model=32, num_layers=1, num_heads=2,
                                   num_kv_heads=1, d_ff=64), seed=0)
    with pytest.raises(ValueError, match=r"attention kernel must be one of the registered \('reference', 'sdpa'"):
        model.set_attention_kernel("spda")
    assert {block.attn.attention_kernel for block in model.layers} == {"reference"}   # unchanged
    q = k = v = torch.zeros(1, 2, 1, 8)
    with pytest.raises(ValueError, match="got 'spda'"):
        grouped_attention(q, k, v, None, kernel="spda")


def _naive_attention(q, k, v, mask, scale):
    """softmax(q k^T * scale) v one query row at a time, in float64, each query head over its group's keys."""
    B, N, T, H = q.shape
    K = k.shape[1]
    out = torch.zeros(B, N, T, v.shape[-1], dtype=torch.float64)
    for b in range(B):
        for n in range(N):
            kv = n // (N // K)
            for t in range(T):
                scores = [float(q[b, n, t].double() @ k[b, kv, s].double()) * scale for s in range(k.shape[2])]
                allowed = [mask is None or bool(mask[min(b, mask.shape[0] - 1), 0, t, s]) for s in range(k.shape[2])]
                top = max(x for x, ok in zip(scores, allowed) if ok)
                weights = [torch.exp(torch.tensor(x - top, dtype=torch.float64)) if ok else torch.tensor(0.0,
                           dtype=torch.float64) for x, ok in zip(scores, allowed)]
                total = sum(weights)
                out[b, n, t] = sum(w / total * v[b, kv, s].double() for s, w in enumerate(weights))
    return out


@pytest.mark.parametrize("masked", [False, True])
def test_sdpa_equals_the_reference_and_a_softmax_written_here(masked):
    g = torch.Generator().manual_seed(7)
    B, N, K, T, S, H = 2, 4, 2, 3, 5, 8
    q, k, v = (torch.randn(B, heads, rows, H, generator=g) for heads, rows in ((N, T), (K, S), (K, S)))
    mask = None
    if masked:   # causal over the last T of S positions, and the first key hidden from batch 1 (padding)
        i, j = torch.arange(S - T, S)[:, None], torch.arange(S)[None, :]
        mask = (j <= i)[None, None].repeat(B, 1, 1, 1)
        mask[1, :, :, 0] = False
    want = _naive_attention(q, k, v, mask, H ** -0.5)
    for name in ("reference", "sdpa"):
        got = grouped_attention(q, k, v, mask, kernel=name)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=name)
    assert ATTENTION.kernels["sdpa"] is torch.nn.functional.scaled_dot_product_attention


def test_an_int4_kernel_registered_here_runs_the_layers_packed_after_it():
    """The linear registry: a kernel of this test's own (it multiplies by w = (u - 8) * scale + zero per group,
    written here) takes the int4 layers packed while it is registered; they match torch's kernel."""
    calls = []

    def pack(unsigned, pairs):
        return unsigned.clone(), pairs.clone()

    def matmul(x, codes, pairs):
        calls.append(x.shape[0])
        group = codes.shape[1] // pairs.shape[0]
        scale = pairs[..., 0].float().t().repeat_interleave(group, 1)         # (O, I)
        zero = pairs[..., 1].float().t().repeat_interleave(group, 1)
        return (x.float() @ ((codes.float() - 8) * scale + zero).t()).to(x.dtype)

    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=False)
    theirs = QuantizedLinear.from_linear(linear, bits=4, group_size=32)
    kernel = Int4Kernel(runs=lambda O, I, group, device, dtype: device.type == "cpu", pack=pack, matmul=matmul)
    x = torch.randn(3, 64).bfloat16()
    LINEAR.register("test int4", kernel)
    try:
        ours = QuantizedLinear.from_linear(linear, bits=4, group_size=32)
        assert ours.packed_weight().kernel == "test int4" and "on test int4" in ours.kernel_summary()
        with torch.no_grad():
            torch.testing.assert_close(ours(x).float(), theirs(x).float(), rtol=2e-2, atol=2e-2)
        assert calls == [3]
    finally:
        LINEAR.unregister("test int4")
    later = QuantizedLinear.from_linear(linear, bits=4, group_size=32)
    assert later.packed_weight().kernel != "test int4"                            # unregistered: not chosen


def test_tuning_is_an_explicit_call_that_says_what_it_changed():
    """`workshop.tune` replaces each plain linear by a `CPULinear` holding the same Parameter (as
    `fuse_projections` replaces modules; no class swapped on a live module), one shared linear by one
    module, keeps a linear's hooks, and returns the line describing what it applied; `untune_cpu` puts
    plain linears holding the same Parameters back."""
    from cs336_inference.workshop import cpu_tuning, tune

    shared = nn.Linear(8, 8, bias=False)
    model = nn.Sequential(nn.Linear(8, 8, bias=False), shared, nn.Sequential(shared), nn.Linear(8, 4, bias=True))
    seen = []
    model[0].register_forward_hook(lambda *a: seen.append("hook"))
    plain = [model[0], shared, model[3]]
    weights = [m.weight for m in plain]
    said = tune(model, split=False, threads=False, huge_pages=False)
    assert said == cpu_tuning.describe(model) and said.startswith("CPU tuning: ")
    assert type(model[0]) is cpu_tuning.CPULinear and model[0] is not plain[0] and plain[0].__class__ is nn.Linear
    assert model[1] is model[2][0] and type(model[1]) is cpu_tuning.CPULinear          # shared: one module
    assert type(model[3]) is nn.Linear                                                  # a bias: left as it is
    assert model[0].weight is weights[0] and model[1].weight is weights[1]              # the same Parameters
    x = torch.randn(2, 8)
    with torch.no_grad():
        want = x @ weights[0].T @ weights[1].T @ weights[1].T @ weights[2].T + model[3].bias
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    assert seen == ["hook"]
    cpu_tuning.untune_cpu(model)
    assert [type(m) for m in (model[0], model[1], model[2][0])] == [nn.Linear] * 3 and model[1] is model[2][0]
    assert model[0].weight is weights[0] and not hasattr(model, "cpu_tuning")
