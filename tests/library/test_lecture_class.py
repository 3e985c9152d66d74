"""The lecture in class: the official lecture's images on screen (by their addresses, nothing downloaded),
a class path (`lecture_10_class`: the sections without their `@deep_dive` functions) that covers every
official section in the official order at about the official length, an inspect panel that shows the value
under discussion, and narration that markdown renders as written (no `*` of a formula read as emphasis, no
heading by accident, no table wider than the screen).

The fast tests read the lecture's source (ast) and call lecture_util; the slow ones run the class path under
edtrace's tracer once per session (conftest.lecture_class_trace_run)."""

import ast
import json
import re
import sys
from pathlib import Path

import pytest

from test_lecture_trace import OFFICIAL_SECTIONS, _calls, _functions, _sections, _tree

pytestmark = pytest.mark.xdist_group("lecture")

ROOT = Path(__file__).resolve().parents[2]
LECTURE_DIR = ROOT / "lecture"
# The official lecture's length (Spring 2026 lecture_10.py traced by edtrace): 437 steps. The class path may
# take 30% more (our live checks), no further.
OFFICIAL_STEPS = 437
MAX_CLASS_STEPS = int(1.3 * OFFICIAL_STEPS)
MAX_FIELDS = 6            # entries of one inspected value (a dict, a dataclass, a list) the panel shows
MAX_TABLE_WIDTH = 100     # characters of a verbatim (monospace) line

# The images the official lecture shows (2026 lecture_10.py, in order, then the 2025 alternatives section's
# last six): `images/NAME` from the official lecture repository, or the address the official lecture uses.
SCALING_BOOK = "https://jax-ml.github.io/scaling-book/assets/img/"
OFFICIAL_IMAGES_2026 = [
    "images/inference-schema.png", SCALING_BOOK + "transformer-diagram.png",
    SCALING_BOOK + "naive-inference-1400.webp", SCALING_BOOK + "cached-inference-1400.webp", SCALING_BOOK + "gmqa.png",
    "images/gqa-speed.png", "images/gqa-accuracy.png", "images/mla-schema.png", "images/mla-accuracy.png",
    "images/mla-accuracy2.png", "images/cla-diagram.png", "images/cla-results.png", "images/longformer-attention.png",
    "images/deepseek-v4-attention.png", "https://www.datocms-assets.com/104802/1709770809-twitter-post-20.png",
    "images/awq-schema.png", "images/pruning-kd-loop.png", "images/pruning-kd.png",
    "images/speculative-sampling-algorithm.png", "images/speculative-sampling-results.png",
    "images/speculative-sampling-stats.png", "images/medusa-eagle.png",
    "https://images.ctfassets.net/xjan103pcp94/1LJioEsEdQQpDCxYNWirU6/82b9fbfc5b78b10c1d4508b60e72fdcf/"
    "cb_02_diagram-static-batching.png",
    "images/paged-attention-fragmentation.png", "images/paged-attention-blocks.png",
    "images/paged-attention-logical.png", "images/paged-attention-sharing.png", "images/paged-attention-parallel.png",
]
OFFICIAL_IMAGES_2025 = ["images/s4-summary.png", "images/based-associative-recall.png", "images/jamba-architecture.png",
                        "images/based-attention.png", "images/diffusion-lm.png",
                        "https://framerusercontent.com/images/K2zvhtaTsz5ehDFoWx6KQHOqCyk.jpg"]
RAW_2026 = "https://raw.githubusercontent.com/stanford-cs336/lectures/main/"
RAW_2025 = "https://raw.githubusercontent.com/stanford-cs336/spring2025-lectures/main/"


def _expected_addresses() -> list[str]:
    def address(path, root):
        return path if path.startswith("https://") else root + path
    return [address(p, RAW_2026) for p in OFFICIAL_IMAGES_2026] + [address(p, RAW_2025) for p in OFFICIAL_IMAGES_2025]


def _lecture_util():
    sys.path.insert(0, str(LECTURE_DIR))
    try:
        import lecture_util
    finally:
        sys.path.remove(str(LECTURE_DIR))
    return lecture_util


def _literal(call: ast.Call, keyword: str):
    value = next((k.value for k in call.keywords if k.arg == keyword), None)
    return ast.literal_eval(value) if value is not None else None


def _figure_images(functions) -> list[tuple[str, str, int]]:
    """(function, image, year) of every figure(..., image=...) call, in source order."""
    found = []
    for name, function in functions.items():
        for call in _calls(function, "figure"):
            image = _literal(call, "image")
            if image is not None:
                found.append((call.lineno, name, image, _literal(call, "year") or 2026))
    return [(name, image, year) for _, name, image, year in sorted(found)]


def test_the_official_list_has_34_distinct_images():
    assert len(set(OFFICIAL_IMAGES_2026 + OFFICIAL_IMAGES_2025)) == 34 == len(set(_expected_addresses()))


def test_every_official_image_is_shown_in_a_section_not_a_deep_dive():
    """Each official image (by file name) appears once, as figure(..., image=...) in a section function or
    main() (the class path runs them), with the official lecture's year for `images/` paths."""
    tree = _tree()
    functions = _functions(tree)
    core = set(_sections(tree)) | {"main"}
    shown = _figure_images(functions)
    outside = [(name, image) for name, image, _ in shown if name not in core]
    assert not outside, f"official images shown only in deep dives (the class path skips them): {outside}"
    names = [Path(image).name for _, image, _ in shown]
    expected = [Path(p).name for p in OFFICIAL_IMAGES_2026 + OFFICIAL_IMAGES_2025]
    assert sorted(names) == sorted(expected), (sorted(set(expected) - set(names)), sorted(set(names) - set(expected)))
    years = {Path(image).name: year for _, image, year in shown if image.startswith("images/")}
    for path in OFFICIAL_IMAGES_2025:
        if path.startswith("images/"):
            assert years[Path(path).name] == 2025, f"{path} lives in the 2025 lecture repository"
    assert shown[0][:2] == ("main", "images/inference-schema.png"), "the title schema opens the lecture"


def test_figure_records_the_address_and_downloads_nothing(monkeypatch):
    """edtrace's own image() fetches a URL into var/files; figure() must not (the viewer loads the address)."""
    import edtrace.execute_util as execute_util
    import edtrace.file_util as file_util
    lecture_util = _lecture_util()

    def no_download(*args, **kwargs):
        raise AssertionError(f"the lecture tried to download {args}")
    monkeypatch.setattr(file_util, "download_file", no_download)
    monkeypatch.setattr(execute_util, "cached", no_download)
    execute_util.pop_renderings()
    lecture_util.figure("GQA speed", "https://arxiv.org/abs/2305.13245", image="images/gqa-speed.png", width=500)
    lecture_util.figure("S4", "https://arxiv.org/abs/2111.00396", image="images/s4-summary.png", year=2025)
    lecture_util.figure("gmqa", SCALING_BOOK + "gmqa.png", image=SCALING_BOOK + "gmqa.png")
    lecture_util.figure("a source only", "https://arxiv.org/abs/2305.13245")
    kinds = [(r.type, r.data if r.type == "image" else r.external_link.url) for r in execute_util.pop_renderings()]
    assert kinds == [("image", RAW_2026 + "images/gqa-speed.png"), ("link", "https://arxiv.org/abs/2305.13245"),
                     ("image", RAW_2025 + "images/s4-summary.png"), ("link", "https://arxiv.org/abs/2111.00396"),
                     ("image", SCALING_BOOK + "gmqa.png"), ("link", SCALING_BOOK + "gmqa.png"),
                     ("link", "https://arxiv.org/abs/2305.13245")]
    for bad, year in (("gqa-speed.png", 2026), ("images/x.png", 2024)):
        with pytest.raises(ValueError, match="official image"):
            lecture_util.official_image_url(bad, year)


def test_deep_dive_runs_in_the_full_lecture_and_leaves_a_note_in_class(monkeypatch):
    import edtrace.execute_util as execute_util
    lecture_util = _lecture_util()
    calls = []

    @lecture_util.deep_dive
    def an_experiment(x):
        calls.append(x)
        return x + 1

    monkeypatch.setitem(lecture_util._PATH, "class", False)
    execute_util.pop_renderings()
    assert an_experiment(1) == 2 and calls == [1] and execute_util.pop_renderings() == []
    monkeypatch.setitem(lecture_util._PATH, "class", True)
    assert an_experiment(2) is None and calls == [1] and lecture_util.is_class_path()
    (note,) = execute_util.pop_renderings()
    assert note.type == "markdown" and "an experiment" in note.data and note.style == {"color": "gray"}


def test_every_narrating_function_is_a_section_or_marked_core_or_deep_dive():
    tree = _tree()
    sections = set(_sections(tree)) | {"main"}
    unmarked = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name not in sections:
            marks = {ast.unparse(d) for d in node.decorator_list}
            narrates = _calls(node, "text") or _calls(node, "figure") or _calls(node, "image")
            if narrates and not marks & {"deep_dive", "core"}:
                unmarked.append(node.name)
    assert not unmarked, f"mark these @deep_dive (full lecture only) or @core: {unmarked}"
    deep = [n.name for n in tree.body if isinstance(n, ast.FunctionDef)
            and "deep_dive" in {ast.unparse(d) for d in n.decorator_list}]
    assert len(deep) >= 15, deep


def test_the_class_module_and_the_cli_run_the_core_of_the_same_file():
    source = (LECTURE_DIR / "lecture_10_class.py").read_text()
    tree = ast.parse(source)
    assert "use_class_path()" in source and "__file__ = lecture_10.__file__" in source
    assert [n.names[0].name for n in tree.body if isinstance(n, ast.Import)][-1] == "lecture_10"
    assert source.index("use_class_path()") < source.index("import lecture_10")   # before the decorators run
    from cs336_inference import cli
    assert cli.build_parser().parse_args(["lecture", "--class"]).class_path
    assert not cli.build_parser().parse_args(["lecture"]).class_path


# ---- markdown: what the viewer (marked) would make of each text() ----

INTENDED_STRONG = re.compile(r"(?<![\w*])\*\*([A-Za-z][A-Za-z -]*[A-Za-z])\*\*(?![\w*])")
INTENDED_EM = re.compile(r"(?<![\w*])\*([A-Za-z][A-Za-z -]*[A-Za-z])\*(?![\w*])")


def markdown_accidents(message: str) -> list[str]:
    """What a markdown parser does to `message` that its author did not write on purpose: a heading or
    another block (rule, quote, code block) from a line that does not start with '#', emphasis other
    than `*word*`/`**words**`, a `*` or `_` that disappears."""
    from markdown_it import MarkdownIt

    md = MarkdownIt("commonmark").enable(["table", "strikethrough"])
    tokens = md.parse(message)
    problems = []
    blocks = {t.type for t in tokens if t.nesting >= 0 and t.level == 0}
    allowed = {"paragraph_open", "bullet_list_open", "ordered_list_open", "inline", "html_inline"}
    if message.startswith("#"):
        allowed = {"heading_open", "inline"}
    unexpected = blocks - allowed
    if unexpected:
        problems.append(f"blocks {sorted(unexpected)}")
    intended = INTENDED_STRONG.sub(r"\1", INTENDED_EM.sub(r"\1", INTENDED_STRONG.sub(r"\1", message)))
    rendered = "".join(c.content for t in tokens if t.type == "inline" for c in t.children
                       if c.type in ("text", "code_inline"))
    for char in "*_":
        if intended.count(char) != rendered.count(char):
            problems.append(f"{intended.count(char) - rendered.count(char)} {char!r} read as markup")
    emphasis = sum(1 for t in tokens if t.type == "inline" for c in t.children if c.type in ("em_open", "strong_open"))
    wanted = len(INTENDED_STRONG.findall(message)) + len(INTENDED_EM.findall(INTENDED_STRONG.sub("", message)))
    if emphasis != wanted:
        problems.append(f"{emphasis} emphasis spans, {wanted} written")
    return problems


def test_markdown_accidents_are_caught():
    assert markdown_accidents("Why **efficiency** matters: *one* request") == []
    assert markdown_accidents("- a list item, 1. not a list") == []
    assert markdown_accidents("2. an ordered item with S_t = a_t S_{t-1}") == []
    assert markdown_accidents('BT<font color="red">D</font> × DH') == []
    assert markdown_accidents("#### A subsection") == []
    assert markdown_accidents("6*B*T*D*F FLOPs over 2*B*D bytes")          # sympy's str(): emphasis
    assert markdown_accidents("---")                                        # a rule
    assert markdown_accidents("    indented four spaces")                   # a code block
    assert markdown_accidents("> a quote")
    assert markdown_accidents("a __dunder__ word")


def _text_literals(tree) -> list[tuple[int, str]]:
    """Each non-verbatim text() argument, f-string placeholders replaced by a plain word."""
    found = []
    for call in _calls(tree, "text"):
        if any(k.arg == "verbatim" for k in call.keywords) or not call.args:
            continue
        arg = call.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            found.append((call.lineno, arg.value))
        elif isinstance(arg, ast.JoinedStr):
            found.append((call.lineno, "".join(v.value if isinstance(v, ast.Constant) else "x" for v in arg.values)))
    return found


def test_every_text_renders_as_written():
    """Every text() of the lecture (f-strings with their values stood in by a word; the slow test renders
    the class path's real values): no accidental emphasis or block, headings only from section(), part()
    and the subsection lines `#### ...` inside a section."""
    tree = _tree()
    texts = _text_literals(tree)
    assert len(texts) > 300
    bad = {line: (message, problems) for line, message in texts if (problems := markdown_accidents(message))}
    assert not bad, bad
    main = _functions(tree)["main"]
    headings = [(call.lineno, call.args[0].value) for call in _calls(tree, "text")
                if isinstance(call.args[0], ast.Constant) and str(call.args[0].value).startswith("#")]
    title = [h for h in headings if h[0] in {c.lineno for c in _calls(main, "text")}]
    assert [h for _, h in title] == ["# Lecture 10: Inference"]
    assert all(h.startswith("#### ") for line, h in headings if (line, h) not in title), headings


# ---- the class path, traced ----

def _class_trace(run) -> dict:
    assert run.returncode == 0, run.failure()
    assert not run.tree_change, f"the class trace changed `git status`:\n{run.tree_change}"
    return json.loads((run.trace_dir / "lecture_10_class.json").read_text())


@pytest.mark.slow
def test_class_path_covers_every_official_section_in_order_at_about_the_official_length(lecture_class_trace_run):
    trace = _class_trace(lecture_class_trace_run)
    assert list(trace["files"]) == ["lecture/lecture_10.py"], "the class path steps through lecture_10.py itself"
    steps = trace["steps"]
    order = []
    for step in steps:
        stack = step["stack"]
        if len(stack) > 1 and stack[0]["function_name"] == "main" and stack[1]["function_name"] not in order:
            order.append(stack[1]["function_name"])
    sections = [name for name in order if name in set(_sections(_tree()))]
    assert sections == [*OFFICIAL_SECTIONS, "summary"], sections
    assert len(steps) <= MAX_CLASS_STEPS, f"{len(steps)} steps (the official lecture: {OFFICIAL_STEPS})"
    deep_dives_run = {s["stack"][-1]["function_name"] for s in steps} - set(_sections(_tree())) - {"main"}
    marked = {n.name for n in _tree().body if isinstance(n, ast.FunctionDef)
              and "deep_dive" in {ast.unparse(d) for d in n.decorator_list}}
    assert not deep_dives_run & marked, f"deep dives ran in class: {deep_dives_run & marked}"
    warnings = [line for line in lecture_class_trace_run.stdout.splitlines() if line.startswith("WARNING")]
    assert not warnings, warnings[:3]


def _fields(value) -> int:
    contents = value["contents"]
    if value["type"] in ("torch.Tensor", "numpy.ndarray"):
        return 1 if not value.get("shape") else value["shape"][-1]
    return len(contents) if isinstance(contents, (dict, list)) else 1


def _panels(steps):
    """The viewer's inspect panel at each step (TraceViewer.renderEnv): the envs of the steps in the same
    frame, merged in order (a name keeps the position it first had), None (cleared) names dropped."""
    for index, step in enumerate(steps):
        stack = step["stack"]
        frame = [(e["path"], e["line_number"]) for e in stack[:-1]]
        envs = []
        for earlier in reversed(steps[:index + 1]):
            other = earlier["stack"]
            if len(other) == len(stack) and [(e["path"], e["line_number"]) for e in other[:-1]] == frame:
                if earlier["env"]:
                    envs.append(earlier["env"])
            elif len(other) < len(stack):
                break
        merged = {}
        for env in reversed(envs):
            merged.update(env)
        yield step, {k: v for k, v in merged.items() if v is not None}


@pytest.mark.slow
def test_class_path_inspect_panel_shows_the_current_value_first_and_small(lecture_class_trace_run):
    steps = _class_trace(lecture_class_trace_run)["steps"]
    source = (LECTURE_DIR / "lecture_10.py").read_text().splitlines()
    wide, buried, inspected = [], [], 0
    for step, panel in _panels(steps):
        top = step["stack"][-1]
        for name, value in step["env"].items():
            if value is not None and _fields(value) > MAX_FIELDS:
                wide.append((top["line_number"], name, _fields(value)))
        current = [n for n, v in step["env"].items() if v is not None]
        if current:
            inspected += 1
            if list(panel)[:len(current)] != current:
                buried.append((top["line_number"], source[top["line_number"] - 1].strip()[:60], list(panel)))
    assert inspected >= 15
    assert not wide, f"inspected values with more than {MAX_FIELDS} fields: {wide}"
    assert not buried, f"the current line's value is not first in the panel (add @clear): {buried}"


@pytest.mark.slow
def test_class_path_renders_as_written_and_shows_every_official_image(lecture_class_trace_run):
    steps = _class_trace(lecture_class_trace_run)["steps"]
    renderings = [r for s in steps for r in s["renderings"]]
    images = [r["data"] for r in renderings if r["type"] == "image"]
    official = _expected_addresses()   # 2026's, then 2025's alternatives_to_the_transformer, which comes after
    in_order = official[:14] + official[-6:] + official[14:-6]   # reduce_kv_cache_size (2026's 14th image)
    assert [i for i in images if i.startswith("https://")] == in_order
    assert all((ROOT / i).is_file() for i in images if not i.startswith("https://"))
    markdown = [r for r in renderings if r["type"] == "markdown"]
    verbatim = [r["data"] for r in markdown if (r.get("style") or {}).get("whiteSpace") == "pre"]
    assert all(len(line) <= MAX_TABLE_WIDTH for line in verbatim), max(verbatim, key=len)
    prose = [r for r in markdown if (r.get("style") or {}).get("whiteSpace") != "pre"]
    bad = {r["data"]: p for r in prose if (p := markdown_accidents(r["data"]))}
    assert not bad, bad
    text_items = [r for r in prose if not r["data"].startswith("#")]
    assert len(text_items) <= 1.3 * 279, len(text_items)     # the official lecture: 279 text items


def test_the_notebook_extra_installs_jupyterlab_and_ci_stays_lean():
    """`pip install -e .[notebook]` gives docs/lecture.md's `jupyter lab`; .ci/setup (the tests run the notebooks
    through nbclient + ipykernel) does not install it."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(re.match(r"jupyterlab\b", requirement) for requirement in extras["notebook"]), extras["notebook"]
    setup = (ROOT / ".ci" / "setup").read_text()
    assert "jupyterlab" not in setup and "notebook]" not in setup and "notebook," not in setup


def test_the_official_wording_and_links_dropped_before_are_back():
    """Issue 50's drift items: sentences, notation and links the official lectures give, in their sections."""
    tree = _tree()
    functions = _functions(tree)

    def said(section):
        return " ".join(message for _, message in _text_literals(functions[section]))
    assert "Inference is huge. Important to make it fast." in said("landscape")
    assert '<font color="red">Contracting (red)</font>' in said("review_transformer")
    assert '<font color="blue">Batching (blue)</font>' in said("review_transformer")
    assert "6·B·T·(params + O(T))" in said("review_transformer")                                 # 2025's rule
    assert "(Mamba 2, GatedDeltaNet)" in said("reduce_kv_cache_size")
    links = _calls(functions["landscape"], "link")
    linked = {c.args[0].id for c in links if c.args and isinstance(c.args[0], ast.Name)}
    urls = {next(k.value.value for k in node.value.keywords if k.arg == "url") for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func) == "Reference" and node.targets[0].id in linked}
    assert {"https://github.com/vllm-project/vllm", "https://sgl-project.github.io/"} <= urls, urls


def test_a_live_measurement_says_so_and_no_committed_plot_stands_beside_it():
    """The roofline timed while the lecture runs is narrated as this machine, now; the committed roofline plot
    (another run, another machine) is not shown beside it."""
    tree = _tree()
    measuring = [f for f in _functions(tree).values()
                 if any(ast.unparse(c.func) == "measure_hardware" for c in ast.walk(f) if isinstance(c, ast.Call))]
    assert measuring
    for function in measuring:
        messages = " ".join(message for _, message in _text_literals(function))
        assert "This machine, now" in messages and "timed just now" in messages, function.name
        assert not _calls(function, "image"), f"{function.name} shows a committed figure beside a live number"
    assert "roofline_matmul_cpu.png" not in (LECTURE_DIR / "lecture_10.py").read_text()
