"""The lecture as an edtrace trace: `python -m edtrace.execute -m lecture_10 -o DIR` (the README's
command) writes a trace with a heading and steps for every section, every `# @inspect` resolves,
and images resolve from any working directory.

The fast tests read the lecture's source (ast); the slow one runs the trace (the whole lecture under
edtrace's line tracer)."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LECTURE = ROOT / "lecture" / "lecture_10.py"
PARTS = ("1. Understanding the inference workload", "2. Taking shortcuts (lossy)",
         "3. Use shortcuts but double check (lossless)", "4. Handling dynamic workloads", "5. Summary")


def _tree() -> ast.Module:
    return ast.parse(LECTURE.read_text())


def _main_calls(tree: ast.Module) -> list[tuple[str, list]]:
    """The calls main() makes, in order: (function name, positional arguments)."""
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    return [(s.value.func.id, s.value.args) for s in main.body
            if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and isinstance(s.value.func, ast.Name)]


def _sections(tree: ast.Module) -> list[str]:
    helpers = ("text", "part", "apply_thread_policy", "link", "image")
    return [name for name, _ in _main_calls(tree) if name not in helpers]


def _inspect_args(line: str) -> list[str] | None:
    """The arguments of `@inspect` directives on a line, parsed as edtrace parses them (the text
    between the first and second '#', tokens after '@inspect' until the next '@...'); None if none."""
    if "#" not in line or "@inspect" not in line.split("#")[1]:
        return None
    args, current = [], None
    for token in line.split("#")[1].split():
        if token.startswith("@"):
            current = token
        elif current == "@inspect":
            args.append(token)
    return args


def _bound_names(stmt: ast.stmt) -> set[str]:
    targets = {ast.Assign: lambda s: s.targets, ast.AugAssign: lambda s: [s.target],
               ast.AnnAssign: lambda s: [s.target]}[type(stmt)](stmt)
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def test_main_has_the_five_parts_in_order_and_every_section_starts_with_its_heading():
    tree = _tree()
    parts = [args[0].value for name, args in _main_calls(tree) if name == "part"]
    assert tuple(parts) == PARTS
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    sections = _sections(tree)
    assert sections[0] == "landscape" and sections[-1] == "summary" and len(sections) >= 12
    for name in sections:
        calls = [s.value for s in functions[name].body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)]
        headings = [c.args[0].value for c in calls if isinstance(c.func, ast.Name) and c.func.id == "section"]
        assert headings == [name], f"{name}() must call section({name!r}) once at its top level, found {headings}"


def test_every_inspect_directive_sits_on_a_one_line_assignment_of_the_names_it_inspects():
    """edtrace reads the directive from the line an event reports and the variables from the frame after
    that line: a directive on a multi-line statement, a name with a trailing comma, or a name the line
    does not assign shows nothing (or a stale value) in the trace."""
    tree = _tree()
    lines = LECTURE.read_text().splitlines()
    statements = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.If, ast.For,
                                                                ast.With, ast.While, ast.Try)):
            statements.setdefault(node.lineno, node)
    found = 0
    for number, line in enumerate(lines, start=1):
        args = _inspect_args(line)
        if args is None:
            continue
        found += 1
        stmt = statements.get(number)
        assert stmt is not None, f"line {number}: @inspect on a line that starts no simple statement: {line.strip()}"
        assert stmt.end_lineno == number, f"line {number}: @inspect on lines {number}-{stmt.end_lineno} (one statement)"
        assert isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign)), f"line {number}: not an assignment"
        assert args, f"line {number}: @inspect without a name"
        for arg in args:
            assert re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", arg), f"line {number}: {arg!r} is not a name"
            assert arg.split(".")[0] in _bound_names(stmt), f"line {number}: {arg!r} is not assigned on that line"
    assert found >= 60


def test_images_resolve_from_the_repository_root_and_from_lecture(monkeypatch):
    sys.path.insert(0, str(ROOT / "lecture"))
    try:
        import lecture_util
        from edtrace.execute_util import pop_renderings
    finally:
        sys.path.remove(str(ROOT / "lecture"))
    pop_renderings()
    for cwd, expected in ((ROOT, "figures/serving.png"), (ROOT / "lecture", "../figures/serving.png")):
        monkeypatch.chdir(cwd)
        lecture_util.image("figures/serving.png", width=100)
        (rendering,) = pop_renderings()
        assert rendering.type == "image" and rendering.data == expected and (cwd / rendering.data).is_file()
    with pytest.raises(FileNotFoundError, match="no_such.png"):
        lecture_util.image("figures/no_such.png")
    lecture_util.section("reduce_kv_cache_size")
    lecture_util.part("2. Taking shortcuts (lossy)")
    assert [r.data for r in pop_renderings()] == ["### Reduce KV cache size", "## 2. Taking shortcuts (lossy)"]


@pytest.mark.slow
def test_trace_has_a_heading_and_steps_for_every_section(tmp_path, git_tree_unchanged):
    """The README's command, from the repository root (the venv has lecture/ on its path, see .ci/setup)."""
    env = {k: v for k, v in os.environ.items() if k != "CS336_FIGURES"}
    env["MPLBACKEND"] = "Agg"
    proc = subprocess.run([sys.executable, "-m", "edtrace.execute", "-m", "lecture_10", "-o", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, f"trace failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    trace = json.loads((tmp_path / "lecture_10.json").read_text())
    assert list(trace["files"]) == ["lecture/lecture_10.py"]
    steps = trace["steps"]

    def markdown(step):
        return [r["data"] for r in step["renderings"] if r["type"] == "markdown"]

    main_text = [m for s in steps if s["stack"][-1]["function_name"] == "main" for m in markdown(s)]
    assert main_text[0] == "# Lecture 10: Inference"
    assert [m for m in main_text if m.startswith("## ")] == [f"## {p}" for p in PARTS]
    sys.path.insert(0, str(ROOT / "lecture"))
    try:
        from lecture_util import section_heading
    finally:
        sys.path.remove(str(ROOT / "lecture"))
    for name in _sections(_tree()):
        own = [s for s in steps if s["stack"][-1]["function_name"] == name]
        assert len(own) >= 3, f"{name}: only {len(own)} steps in the trace"
        narration = [m for s in own for m in markdown(s)]
        assert narration[:1] == [f"### {section_heading(name)}"], f"{name}: the trace shows {narration[:1]} first"
        assert len(narration) >= 2, f"{name}: no narration in the trace"
    # Every executed @inspect line carries the values of the names it inspects (edtrace also steps into a
    # comprehension on such a line and warns there, where the names do not exist yet: harmless).
    lines = LECTURE.read_text().splitlines()
    shown: dict[int, set] = {}
    for step in steps:
        top = step["stack"][-1]
        if _inspect_args(lines[top["line_number"] - 1]):
            shown.setdefault(top["line_number"], set()).update(step["env"])
    for number, names in shown.items():
        args = set(_inspect_args(lines[number - 1]))
        assert args <= names, f"line {number}: the trace shows {sorted(names)}, not {sorted(args - names)}"
    assert len(shown) >= 60
    if "Skipping the real model" not in proc.stdout:   # then every @inspect line ran
        assert len(shown) == sum(_inspect_args(line) is not None for line in lines)
    images = [r["data"] for s in steps for r in s["renderings"] if r["type"] == "image"]
    assert images and all((ROOT / path).is_file() for path in images)
