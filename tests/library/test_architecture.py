"""The package's import graph: no cycles between modules, and sub-packages only import downward.

Not graded: this checks the library's own layout (see docs/architecture.md, "Where things live").
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG_DIR = Path(__file__).resolve().parents[2] / "src" / "cs336_inference"

# Each part of the package may import only parts with a lower rank (and itself).
LAYERS = {
    "_checks": 0, "device": 0, "timing": 0, "figures": 0, "tables": 0,
    "progress": 0,                   # a start-up's progress lines and phase marks (standard library only)
    "model": 1,
    "generation": 2,
    "accounting": 3, "quantization": 3,
    "data": 4,
    "compression": 5, "serving": 5,
    "parallel": 5,                   # tensor parallelism over torch.distributed (model, generation)
    "shipped_models": 6,             # how the shipped toy models are made (training + pruning)
    "model_source": 6,               # what --model names: a model by name or a checkpoint file, and its tokenizer
    "workshop": 7,                   # the performance workshop: fast path, CPU tuning, our kernels, benchmarks
    "homework": 7,                   # the graded functions' reference solution and the student skeleton
    "cli": 8, "cli_args": 8, "cli_tensor_parallel": 8, "chat_repl": 8, "__main__": 8, "__init__": 8,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PKG_DIR).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["cs336_inference", *parts])


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PKG_DIR.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Package modules imported by `name` anywhere in its file (function-level imports included)."""
    is_pkg = path.name == "__init__.py"
    package = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if not target.startswith("cs336_inference"):
                continue
            for alias in node.names:  # `from pkg import submodule` points at the submodule
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("cs336_inference"))
    return {m for m in found if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_part_has_a_layer():
    missing = sorted({_part(m) for m in _modules()} - set(LAYERS))
    assert not missing, f"parts of the package with no layer in LAYERS: {missing}; add them to this test"


def test_no_import_cycles_between_modules():
    graph = _graph()
    state: dict[str, int] = {}   # 1 = on the current path, 2 = done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_parts_only_import_downward():
    upward = []
    for module, targets in _graph().items():
        for target in targets:
            src, dst = _part(module), _part(target)
            if src != dst and dst != "__init__" and LAYERS[dst] > LAYERS[src]:
                upward.append(f"{module} -> {target}")
            if dst == "__init__" and src != "__init__":
                upward.append(f"{module} -> {target} (import the part, not the top-level package)")
    assert not upward, "imports that point upward:\n  " + "\n  ".join(sorted(upward))
