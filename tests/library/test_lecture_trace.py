"""The lecture as an edtrace trace: `python -m edtrace.execute -m lecture_10 -o DIR` (docs/lecture.md's
command) writes a trace with a heading and steps for every section, every `# @inspect` resolves,
images resolve from any working directory; and the lecture steps like the official one: its sections in
the official order, a link to the source of every figure the official lecture shows, short `text()`
lines, no line that traces more than a few steps, no edtrace warnings.

The fast tests read the lecture's source (ast); the slow ones run the trace (the whole lecture under
edtrace's line tracer, once per session: conftest.lecture_trace_run)."""

import ast
import json
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

# Under pytest-xdist (`.ci/run`: the slow tests on two workers, --dist loadgroup) the tests that read the
# lecture's runs share one worker, so each whole-lecture run (a session fixture) happens once (conftest).
pytestmark = pytest.mark.xdist_group("lecture")

ROOT = Path(__file__).resolve().parents[2]
LECTURE = ROOT / "lecture" / "lecture_10.py"
PARTS = ("1. Understanding the inference workload", "2. Taking shortcuts (lossy)",
         "3. Use shortcuts but double check (lossless)", "4. Handling dynamic workloads", "5. Summary")
# The official lecture's section functions, in its order (Spring 2026, plus 2025's alternatives_to_the_transformer)
OFFICIAL_SECTIONS = ("landscape", "review_transformer", "review_of_arithmetic_intensity",
                     "arithmetic_intensity_of_inference", "throughput_and_latency", "reduce_kv_cache_size",
                     "alternatives_to_the_transformer", "quantization", "model_pruning", "speculative_sampling",
                     "continuous_batching", "paged_attention")

ARXIV, SCALING_BOOK = "https://arxiv.org/abs/", "https://jax-ml.github.io/scaling-book/assets/img/"
HF_INT8 = "https://huggingface.co/blog/assets/96_hf_bitsandbytes_integration/"
# Each figure the official lecture (2025 and 2026 files) shows, by section: the source `figure()` must link
# (the image itself where it is on the web, else the paper or post it comes from). Not listed: 2026's
# opening images/inference-schema.png (the course's own drawing, no source to link).
OFFICIAL_FIGURES = {
    "landscape": ["https://x.com/sama/status/1756089361609981993",            # openai-100b-tokens.png
                  "https://x.com/amanrsanger/status/1916968123535880684"],    # cursor-1b-lines.png
    "review_transformer": [SCALING_BOOK + "transformer-diagram.png"],
    "arithmetic_intensity_of_inference": [SCALING_BOOK + "naive-inference-1400.webp",
                                          SCALING_BOOK + "cached-inference-1400.webp"],
    "reduce_kv_cache_size": [SCALING_BOOK + "gmqa.png",
                             ARXIV + "2305.13245", ARXIV + "2305.13245",       # gqa-speed, gqa-accuracy
                             *[ARXIV + "2405.04434"] * 3,                      # mla-schema, Tables 8 and 9
                             ARXIV + "2405.12981", ARXIV + "2405.12981",       # cla-diagram, cla-results
                             ARXIV + "2004.05150",                             # longformer-attention
                             "https://research.character.ai/content/images/2024/06/figure1-2-1.png",
                             "https://huggingface.co/deepseek-ai/DeepSeek-V4-Pro/blob/main/DeepSeek_V4.pdf"],
    "alternatives_to_the_transformer": [ARXIV + "2111.00396",                  # s4-summary.png
                                        ARXIV + "2402.18668",                  # based-associative-recall.png
                                        ARXIV + "2403.19887",                  # jamba-architecture.png
                                        ARXIV + "2402.18668",                  # based-attention.png
                                        ARXIV + "2205.14217",                  # diffusion-lm.png
                                        "https://framerusercontent.com/images/K2zvhtaTsz5ehDFoWx6KQHOqCyk.jpg"],
    "quantization": ["https://www.datocms-assets.com/104802/1709770809-twitter-post-20.png",
                     HF_INT8 + "quant-freeze.png", HF_INT8 + "Mixed-int8.gif",
                     "https://huggingface.co/blog/hf-bitsandbytes-integration",   # llm-int8-bloom.png
                     ARXIV + "2306.00978"],                                       # awq-schema.png
    "model_pruning": [ARXIV + "2407.14679", ARXIV + "2407.14679"],                # pruning-kd-loop, pruning-kd
    # speculative-sampling-algorithm, -results, -stats; medusa-eagle
    "speculative_sampling": [ARXIV + "2302.01318"] * 3 + [ARXIV + "2401.15077"],
    "continuous_batching": ["https://images.ctfassets.net/xjan103pcp94/1LJioEsEdQQpDCxYNWirU6/"
                            "82b9fbfc5b78b10c1d4508b60e72fdcf/cb_02_diagram-static-batching.png"],
    "paged_attention": [ARXIV + "2309.06180"] * 5,   # fragmentation, blocks, two requests, sharing, parallel sampling
}
# Links the official lecture gives where it gives them (issue 21's dropped links), by section.
OFFICIAL_LINKS = {
    "review_transformer": ["https://jax-ml.github.io/scaling-book/transformers/"],
    "arithmetic_intensity_of_inference": ["https://jax-ml.github.io/scaling-book/inference/"],
    "throughput_and_latency": ["https://jax-ml.github.io/scaling-book/inference/"],   # sharding
    "landscape": ["https://www.youtube.com/watch?v=8BaEwoTk8XI",                     # vLLM talk
                  "https://huggingface.co/docs/text-generation-inference/en/index",   # TGI
                  "https://nvidia.github.io/TensorRT-LLM/overview.html"],
    "reduce_kv_cache_size": [ARXIV + "1904.10509"],                                   # sparse transformer
    "alternatives_to_the_transformer": [
        "https://docs.google.com/presentation/d/1wrQO4uzwWr73SGj7aFxeVR9Cz0PY-mzJipn12enM39k/edit#slide=id.p",
        ARXIV + "2111.00396", ARXIV + "2312.00752", ARXIV + "2403.19887", ARXIV + "2402.18668",
        ARXIV + "2501.08313", ARXIV + "2205.14217", "https://www.inceptionlabs.ai/news",
        "https://x.com/i/status/1894847919624462794"],
    "quantization": ["https://apxml.com/posts/llm-quantization-techniques-explained",  # overview of approaches
                     ARXIV + "2310.18313", ARXIV + "2303.17951", ARXIV + "2208.07339", ARXIV + "2210.17323"],
    "speculative_sampling": ["https://storage.googleapis.com/gweb-research2023-media/media/"
                             "SpeculativeDecoding-1-Illustration.mp4",
                             "https://research.google/blog/looking-back-at-speculative-decoding/"],
    "continuous_batching": ["https://www.usenix.org/system/files/osdi22-yu.pdf",
                            "https://www.youtube.com/watch?v=Ob9PPLxETYU"],                # Orca paper and talk
}
# Facts the official lecture states that ours must state too (issue 21's dropped facts), by section.
OFFICIAL_FACTS = {
    "landscape": ["test-time compute", "TGI", "OpenAI, Anthropic, Google",
                  "Together, Fireworks, Baseten, DeepInfra, Groq, Cerebras"],
    "quantization": ["15-23% slower than fp16", "if you dare", "cheaper than fp8", "maximum is 448"],
    "model_pruning": ["1024 samples"],
    "alternatives_to_the_transformer": ["S4", "associative recall", "1B", "1:7", "52B", "456B", "O(T) KV cache",
                                        "O(1) state", "Inception Labs"],
}


def _tree() -> ast.Module:
    return ast.parse(LECTURE.read_text())


def _main_calls(tree: ast.Module) -> list[tuple[str, list]]:
    """The calls main() makes, in order: (function name, positional arguments)."""
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    return [(s.value.func.id, s.value.args) for s in main.body
            if isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) and isinstance(s.value.func, ast.Name)]


def _sections(tree: ast.Module) -> list[str]:
    helpers = ("text", "part", "apply_thread_policy", "link", "image", "figure")
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


def _functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def _calls(node: ast.AST, name: str) -> list[ast.Call]:
    return [c for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id == name]


def _reference_urls(tree: ast.Module) -> dict[str, str]:
    """Module-level `name = Reference(..., url="...")`: name -> url."""
    urls = {}
    for node in tree.body:
        value = getattr(node, "value", None)
        if isinstance(node, ast.Assign) and isinstance(value, ast.Call) and ast.unparse(value.func) == "Reference":
            url = next((k.value for k in node.value.keywords if k.arg == "url"), None)
            if isinstance(url, ast.Constant):
                urls[node.targets[0].id] = url.value
    return urls


def _narrating_functions(tree: ast.Module) -> set[str]:
    """Lecture functions that narrate (call text() or section()): stepping into them is the point."""
    return {name for name, f in _functions(tree).items() if _calls(f, "text") or _calls(f, "section")}


def test_sections_are_the_official_ones_in_the_official_order():
    tree = _tree()
    sections = _sections(tree)
    assert [s for s in sections if s in OFFICIAL_SECTIONS] == list(OFFICIAL_SECTIONS), sections


def test_every_official_figure_is_linked_where_the_official_lecture_shows_it():
    functions = _functions(_tree())
    for section, urls in OFFICIAL_FIGURES.items():
        calls = _calls(functions[section], "figure")
        assert all(len(c.args) == 2 and all(isinstance(a, ast.Constant) for a in c.args) for c in calls), section
        linked = Counter(c.args[1].value for c in calls)
        missing = Counter(urls) - linked
        assert not missing, f"{section}: no figure() linking {dict(missing)}"


def test_the_official_links_are_given_where_the_official_lecture_gives_them():
    tree = _tree()
    functions, references = _functions(tree), _reference_urls(tree)
    for section, urls in OFFICIAL_LINKS.items():
        linked = {references.get(c.args[0].id) for c in _calls(functions[section], "link")
                  if c.args and isinstance(c.args[0], ast.Name)}
        assert set(urls) <= linked, f"{section}: no link to {sorted(set(urls) - linked)}"


def test_inspect_lines_that_edtrace_would_step_into_are_stepped_over():
    """edtrace reads a line's `@inspect` names in every frame that reports that line: a generator,
    dict or set comprehension (their own frames in Python 3.11), or a call into a lecture function,
    reports it too, where the names do not exist ("variable ... not found"). `@stepover` skips them."""
    tree = _tree()
    lines = LECTURE.read_text().splitlines()
    helpers = set(_functions(tree))
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt) or isinstance(node, (ast.FunctionDef, ast.For, ast.If, ast.With)):
            continue
        line = lines[node.lineno - 1]
        if not _inspect_args(line):
            continue
        frames = [n for n in ast.walk(node) if isinstance(n, (ast.GeneratorExp, ast.DictComp, ast.SetComp))
                  or (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in helpers)]
        if frames:
            assert "@stepover" in line.split("#", 1)[1], f"line {node.lineno}: needs @stepover: {line.strip()}"


def test_text_lines_are_one_short_statement_each():
    """One idea per text() line, as in the official lecture: a one-line statement (a multi-line one
    traces once per line it spans), short (the slow test measures the rendered average)."""
    lengths = []
    for call in _calls(_tree(), "text"):
        if any(k.arg == "verbatim" for k in call.keywords) or not call.args:
            continue
        assert call.lineno == call.end_lineno, f"line {call.lineno}: text() spans several lines"
        arg = call.args[0]
        if isinstance(arg, ast.Constant):
            lengths.append(len(arg.value))
        elif isinstance(arg, ast.JoinedStr):   # a placeholder renders as a few characters
            lengths.append(sum(len(v.value) if isinstance(v, ast.Constant) else 6 for v in arg.values))
    assert len(lengths) > 300 and max(lengths) <= 130 and sum(lengths) / len(lengths) <= 90, (
        max(lengths), sum(lengths) / len(lengths))


def _markdown(step) -> list[str]:
    return [r["data"] for r in step["renderings"] if r["type"] == "markdown"]


def _trace(run) -> dict:
    assert run.returncode == 0, run.failure()
    assert not run.tree_change, f"the trace run changed `git status`:\n{run.tree_change}"
    return json.loads((run.trace_dir / "lecture_10.json").read_text())


@pytest.mark.slow
def test_trace_has_a_heading_and_steps_for_every_section(lecture_trace_run):
    """docs/lecture.md's command, from the repository root (the venv has lecture/ on its path, see .ci/setup)."""
    trace = _trace(lecture_trace_run)
    assert list(trace["files"]) == ["lecture/lecture_10.py"]
    steps = trace["steps"]
    main_text = [m for s in steps if s["stack"][-1]["function_name"] == "main" for m in _markdown(s)]
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
        narration = [m for s in own for m in _markdown(s)]
        assert narration[:1] == [f"### {section_heading(name)}"], f"{name}: the trace shows {narration[:1]} first"
        assert len(narration) >= 2, f"{name}: no narration in the trace"
    # Every executed @inspect line carries the values of the names it inspects.
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
    if "Skipping the real model" not in lecture_trace_run.stdout:   # then every @inspect line ran
        assert len(shown) == sum(_inspect_args(line) is not None for line in lines)
    images = [r["data"] for s in steps for r in s["renderings"] if r["type"] == "image"]
    files = [path for path in images if not path.startswith("https://")]   # the official images: their addresses
    assert files and all((ROOT / path).is_file() for path in files) and len(images) - len(files) >= 34


@pytest.mark.slow
def test_trace_steps_like_the_official_lecture(lecture_trace_run):
    """No edtrace warnings; rendered text() lines short on average (the official lecture's average 63
    characters; ours at most 100); no statement traces more than 10 steps (a call into a narrating
    function, a section, is the one exception: stepping into it is the point); the official facts are
    stated in their sections."""
    trace = _trace(lecture_trace_run)
    warnings = [line for line in lecture_trace_run.stdout.splitlines() if line.startswith("WARNING")]
    assert not warnings, f"{len(warnings)} edtrace warnings, e.g. {warnings[:3]}"
    steps = trace["steps"]
    prose = [m for s in steps for r in s["renderings"] if r["type"] == "markdown" and not (r.get("style") or {})
             for m in [r["data"]] if not m.startswith("#")]
    average = sum(map(len, prose)) / len(prose)
    assert len(prose) > 300 and average <= 100, (len(prose), average)
    tables = [r["data"] for s in steps for r in s["renderings"]
              if r["type"] == "markdown" and (r.get("style") or {}).get("whiteSpace") == "pre"]
    assert tables and max(map(len, tables)) <= 100, f"a table line of {max(map(len, tables))} characters overflows"

    tree = _tree()
    statement_of = {}   # line -> the innermost simple statement spanning it
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.If, ast.For, ast.With, ast.Try)):
            for line in range(node.lineno, node.end_lineno + 1):
                other = statement_of.get(line)
                if other is None or node.end_lineno - node.lineno < other.end_lineno - other.lineno:
                    statement_of[line] = node
    narrating = _narrating_functions(tree)

    def is_narrating_call(stmt) -> bool:
        return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                and isinstance(stmt.value.func, ast.Name) and stmt.value.func.id in narrating)

    longest: dict[int, int] = {}   # statement's first line -> most steps in one execution of it
    run_length: dict[int, int] = {}
    previous: list = []
    for step in steps:
        frames = [(e["function_name"], statement_of.get(e["line_number"])) for e in step["stack"]
                  if e["path"] == "lecture/lecture_10.py"]
        for depth, (_, stmt) in enumerate(frames):
            if stmt is None:
                continue
            same = previous[:depth + 1] == frames[:depth + 1]
            run_length[stmt.lineno] = run_length.get(stmt.lineno, 0) + 1 if same else 1
            longest[stmt.lineno] = max(longest.get(stmt.lineno, 0), run_length[stmt.lineno])
        previous = frames
    lines = LECTURE.read_text().splitlines()
    heavy = {n: lines[n - 1].strip() for n, count in longest.items()
             if count > 10 and not is_narrating_call(statement_of[n])}
    assert not heavy, f"statements tracing more than 10 steps (add @stepover or split them): {heavy}"

    functions = _functions(tree)
    for section, facts in OFFICIAL_FACTS.items():
        assert section in functions
        said = " ".join(m for s in steps if any(e["function_name"] == section for e in s["stack"])
                        for m in _markdown(s))
        for fact in facts:
            assert fact in said, f"{section} never says {fact!r}"
