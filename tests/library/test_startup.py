"""A start in seconds: phase marks, the progress ticker, the inductor cache folder, our kernels' build
folder, the decode step compiled in the background (eager until it is ready, then switched between
steps), and `bench startup`'s pieces."""

import io
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from cs336_inference import progress
from cs336_inference.workshop import startup
from cs336_inference.generation import extend, stream
from cs336_inference.model import checkpoints
from cs336_inference.workshop.kernels import cpu_attention
from smollm2_reference import smollm2_file

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target():
    return checkpoints.load_pretrained("target")


def test_marks_are_written_only_where_the_environment_asks(tmp_path, monkeypatch):
    log = tmp_path / "marks.jsonl"
    monkeypatch.delenv(progress.STARTUP_LOG, raising=False)
    progress.mark("loaded")
    assert not log.exists()
    monkeypatch.setenv(progress.STARTUP_LOG, str(log))
    before = time.time()
    progress.mark("loaded")
    progress.mark("first_token", note=1)
    with open(log, "a") as f:
        f.write('{"phase": "torn')                 # a process killed mid-write
    marks = progress.read_marks(log)
    assert [m["phase"] for m in marks] == ["loaded", "first_token"] and marks[1]["note"] == 1
    assert all(before <= m["t"] <= time.time() and m["pid"] == os.getpid() for m in marks)
    monkeypatch.setenv(progress.STARTUP_LOG, str(tmp_path / "missing" / "marks.jsonl"))
    progress.mark("loaded")                         # an unwritable log changes nothing
    assert progress.read_marks(tmp_path / "none.jsonl") == []


def test_the_ticker_counts_while_the_block_runs_and_ends_its_line():
    out = io.StringIO()
    with progress.ticker("building", every=0.01, stream=out) as t:
        time.sleep(0.2)
    text = out.getvalue()
    assert t.ticks >= 2 and text.startswith("building...") and text.count("building... ") >= t.ticks
    assert text.rstrip("\n").endswith(")") and "building... done (" in text and text.endswith("\n")
    out = io.StringIO()
    with pytest.raises(KeyError), progress.ticker("converting", every=10, stream=out):
        raise KeyError("x")
    assert "converting... failed (" in out.getvalue()
    with pytest.raises(ValueError, match="every"):
        progress.Ticker("x", every=0)
    with pytest.raises(ValueError, match="what"):
        progress.Ticker("")


def test_the_inductor_cache_goes_to_the_package_cache_folder_unless_the_user_chose_one(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("CS336_CACHE_DIR", str(tmp_path / "pkg"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert startup.use_cache_dirs() == tmp_path / "pkg" / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "pkg" / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())   # what torch writes there itself
    assert startup.use_cache_dirs() == tmp_path / "pkg" / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's own choice is kept
    assert startup.use_cache_dirs() == tmp_path / "mine"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_importing_the_package_and_its_fast_path_sets_no_cache_folder():
    code = ("import os; import cs336_inference.cli, cs336_inference.workshop.fast_path, "
            "cs336_inference.workshop.startup; "
            "print('TORCHINDUCTOR_CACHE_DIR' in os.environ)")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_our_kernels_build_folder_is_named_by_the_sources_and_flags(tmp_path, monkeypatch):
    a, b = tmp_path / "a.cpp", tmp_path / "b.h"
    a.write_text("int f() { return 1; }")
    b.write_text("#define X 1")
    monkeypatch.setattr(cpu_attention, "SOURCES", [a])
    monkeypatch.setattr(cpu_attention, "HEADERS", [b])
    key = cpu_attention._build_key()
    assert key == cpu_attention._build_key() and len(key) == 12
    b.write_text("#define X 2")                      # a header changed: another folder
    assert cpu_attention._build_key() != key
    b.write_text("#define X 1")
    monkeypatch.setattr(cpu_attention, "_FLAGS", [*cpu_attention._FLAGS, "-DMORE"])
    assert cpu_attention._build_key() != key


def _eager(model):
    return lambda ids, cache: model(ids[:, None], cache=cache)[:, -1]


def _answer(model, decode, n=12, after=None):
    """Greedy tokens of a fixed prompt through `decode`; after(i) runs before the i-th decode step."""
    cache = model.new_cache(1, 64)
    tokens = []
    with torch.inference_mode():
        for i, token in enumerate(stream(model, cache, extend(model, cache, [5, 17, 42, 9]), n, decode=decode)):
            tokens.append(token)
            if after is not None:
                after(i)
    return tokens


def test_a_background_compile_runs_eagerly_until_ready_then_switches_between_steps(target):
    """A slow fake compile, released by the test: the steps before it is ready run the eager step, the
    steps after run the "compiled" one, each step whole on one of them, and the tokens are the eager ones."""
    eager = _eager(target)
    calls, release, prepared = [], threading.Event(), []
    compiled = lambda ids, cache: calls.append("compiled") or eager(ids, cache)   # noqa: E731
    plain = lambda ids, cache: calls.append("eager") or eager(ids, cache)         # noqa: E731

    def prepare():
        prepared.append(threading.current_thread() is threading.main_thread())
        return lambda: release.wait(30) or (_ for _ in ()).throw(TimeoutError("never released"))

    step = startup.BackgroundCompile(compiled, plain, prepare)
    assert not step.started
    default = sys.getswitchinterval()
    step.start()
    step.start()                                       # once only
    assert prepared == [True]                          # prepare ran in the caller's thread, once
    assert sys.getswitchinterval() == pytest.approx(startup.SWITCH_INTERVAL_S)   # eager steps get the GIL sooner

    def after(i):
        if i == 4:                                     # after four eager steps the compile is "done"
            release.set()
            assert step.wait(30) and step.ready

    tokens = _answer(target, step, after=after)
    assert sys.getswitchinterval() == default          # the short switch interval lasted as long as the compile
    assert tokens == _answer(target, eager)
    assert calls == ["eager"] * 4 + ["compiled"] * 7 and (step.eager_calls, step.compiled_calls) == (4, 7)
    assert step.error is None and step.seconds is not None


def test_a_failed_background_compile_is_said_once_and_the_eager_step_carries_on(target):
    eager = _eager(target)
    out = io.StringIO()

    def warm_up():
        raise RuntimeError("g++ went away\nlast line")

    step = startup.BackgroundCompile(lambda *a: pytest.fail("the failed compiled step ran"), eager,
                                     lambda: warm_up, stream=out).start()
    assert step.wait(30) and not step.ready
    assert _answer(target, step) == _answer(target, eager)
    assert out.getvalue().count("failed") == 1 and "RuntimeError: last line" in out.getvalue()
    assert step.eager_calls == 11 and step.compiled_calls == 0


def test_a_background_compile_never_started_is_the_compiled_step():
    step = startup.BackgroundCompile(lambda x: ("compiled", x), lambda x: ("eager", x), lambda: (lambda: None))
    assert step(3) == ("compiled", 3) and not step.wait(0)
    with pytest.raises(TypeError, match="prepare"):
        startup.BackgroundCompile(len, len, None)
    with pytest.raises(TypeError, match="warm-up"):
        startup.BackgroundCompile(len, len, lambda: 3).start()


def test_the_fast_paths_step_compiles_in_the_background_and_answers_as_before(target, tmp_path, monkeypatch):
    """`compiled_decode_step` + `start()` (what chat and generate do): eager answers at once, the compiled
    step after it is ready, and the inductor cache under the package's cache folder; the same greedy tokens."""
    from cs336_inference.workshop import fast_path

    monkeypatch.setenv("CS336_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    compiles = []

    def fake_compile(fn, **options):            # torch.compile as a recorder: no minutes of C++ here
        def run(*args, **kwargs):
            compiles.append(threading.current_thread() is threading.main_thread())
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    step, how = fast_path.compiled_decode_step(target)
    if step is None:
        pytest.skip(how)
    assert str(tmp_path / "inductor") in how and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    step.start()
    assert step.wait(60) and step.ready and compiles and not compiles[0]   # warmed up in the background thread
    tokens = _answer(target, step)
    assert tokens == _answer(target, _eager(target)) and step.compiled_calls == 11


def test_compiling_in_the_background_is_said_and_the_cli_does_not_wait(capsys):
    from cs336_inference import cli

    started = []

    class Step:
        @property
        def started(self):
            return bool(started)

        def start(self):
            started.append(1)

    cli._compile_first("compiled decode", decode=Step(), warm_up=lambda: pytest.fail("warm_up ran in the caller"))
    assert started == [1]
    assert "compiled decode: compiling in the background" in capsys.readouterr().err


def test_watched_output_times_the_first_token_and_the_longest_silence():
    from cs336_inference.workshop.benchmarks import startup as bench

    # like a server: it runs until stopped, and SIGINT ends it with status 0 (a child that exited by itself
    # could race the stop's SIGINT through its interpreter's shutdown, status -2)
    code = ("import signal, sys, time; signal.signal(signal.SIGINT, lambda *_: sys.exit(0)); print('a', flush=True); "
            "time.sleep(0.3); print('model> hi', flush=True); time.sleep(60)")
    child = bench.Watched([sys.executable, "-c", code], dict(os.environ))
    deadline = time.monotonic() + 60
    while child.first_time("out", bench._reply_started) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    ready = child.first_time("out", bench._reply_started)
    assert child.stop() == 0 and ready is not None and ready > child.t0
    assert child.first_time("out", lambda out: "a" in out) < ready
    assert 0.25 <= child.longest_silence(ready) <= ready - child.t0
    assert not bench._reply_started("you> model> ") and bench._reply_started("you> model> P")


@pytest.mark.slow
@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_bench_startup_times_a_real_start_of_each_command(command):
    """One start of each command with the user's caches (the toy target; chat, which refuses a model without
    a chat template, on SmolLM2): its phases in order and a first token (or /health) after them."""
    pytest.importorskip("uvicorn") if command == "serve" else None
    from cs336_inference.workshop.benchmarks import startup as bench
    from cs336_inference.model.disk_cache import cache_dir

    model = "target"
    if command == "chat":
        if smollm2_file() is None:
            pytest.skip("chat needs a model with a chat template: SmolLM2 is not installed")
        model = "smollm2-135m"
    result = bench.start_once(command, model, str(cache_dir()), chat_template=command == "chat", timeout=600)
    assert result["ready_s"] is not None, result.get("error")
    phases = result["phases"]
    assert list(phases)[:3] == ["imported", "loaded", "tuned"]
    assert phases["imported"] < phases["loaded"] <= phases["tuned"] <= result["ready_s"]
    if command == "generate":
        assert phases["tuned"] <= phases["first_token"] <= result["ready_s"] and result["returncode"] == 0
    json.dumps(result)


def test_the_servers_decode_steps_compile_in_the_background_and_serve_the_same_tokens(target, monkeypatch):
    """`compiled_engine_decode` + `start()` (what `serve` does): a warm-up engine of its own compiles in a
    background thread while the server's engine steps eagerly; afterwards its decode-only steps run the
    compiled blocks, with the eager engine's tokens, and no block keeps a patched forward."""
    from cs336_inference.workshop import fast_path
    from cs336_inference.serving import Engine
    from cs336_inference.serving.request import SamplingParams

    threads = []

    def fake_compile(fn, **options):
        def run(*args, **kwargs):
            threads.append(threading.current_thread() is threading.main_thread())
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    decode, how = fast_path.compiled_engine_decode(target)
    if decode is None:
        pytest.skip(how)

    def answers(engine):
        for i, prompt in enumerate(([3, 4, 5] * 7, [9, 8] * 10)):
            engine.add_request(prompt, SamplingParams(max_tokens=10), request_id=str(i))
        out = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out

    decode.start()
    assert decode.wait(120) and decode.ready and threads and not any(threads)   # compiled in the background only
    calls = len(threads)
    served = answers(Engine(target, max_num_seqs=4, decode=decode))
    assert served == answers(Engine(target, max_num_seqs=4)) and len(threads) > calls and decode.compiled_calls
    assert not any("forward" in vars(block) for block in target.layers)


def test_info_says_where_the_caches_are(tmp_path, monkeypatch, capsys):
    from cs336_inference.cli import main

    monkeypatch.setenv("CS336_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert main(["info"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("caches: "))
    assert str(tmp_path) in line and str(tmp_path / "inductor") in line
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ   # info only says where; it sets nothing


def _int4_target(store):
    from cs336_inference.quantization import quantize_model
    from cs336_inference.quantization.kernels import reuse_packed

    model = checkpoints.load_pretrained("target", dtype=torch.bfloat16)
    with reuse_packed(store):
        return quantize_model(model, "rtn", bits=4, group_size=32, symmetric=False)


def test_packed_layouts_kept_from_one_build_are_reused_by_the_next_through_the_disk_cache(tmp_path):
    """A build inside `reuse_packed` records every layer's kernel layout; one more, fed those records after a
    round trip through the verified disk cache (memory-mapped), packs nothing (neither the kernel layouts nor
    the stored codes) and runs the same numbers; a record whose key does not match its layer (another shape
    or layout) is packed again instead."""
    from cs336_inference.model.disk_cache import read_verified, write_verified
    from cs336_inference.quantization import kernels, linear
    from cs336_inference.quantization.linear import QuantizedLinear

    first = _int4_target(kernels.PackedStore())
    layers = [m for m in first.modules() if isinstance(m, QuantizedLinear) and m._packed is not None]
    store = kernels.PackedStore()
    first = _int4_target(store)
    # per int4 layer two records: its stored codes (`qweight`), then its kernel layout
    assert layers and store.reused == 0 and len(store.made) == 2 * len(layers)
    path = tmp_path / "packed.pt"
    write_verified(path, lambda p: torch.save(store.made, p))
    entries = read_verified(path, lambda p: torch.load(p, mmap=True, weights_only=True))

    packs, codes = [], []
    real_pack, real_codes = kernels.pack_weight, linear.pack_int4
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "pack_weight", lambda *a, **k: packs.append(1) or real_pack(*a, **k))
        mp.setattr(linear, "pack_int4", lambda *a, **k: codes.append(1) or real_codes(*a, **k))
        again = kernels.PackedStore(entries)
        second = _int4_target(again)
        assert packs == [] and codes == [] and again.reused == 2 * len(layers)
        layout = next(i for i, e in enumerate(entries) if "layout" in e)
        entries[layout]["key"] = entries[layout]["key"].replace("x", "y")          # a record for another shape
        entries[0]["key"] = entries[0]["key"].replace("x", "y")
        third_store = kernels.PackedStore(entries)
        _int4_target(third_store)
        assert len(packs) == 1 and len(codes) == 1 and third_store.reused == 2 * len(layers) - 2
    for a, b in zip(layers, [m for m in second.modules() if isinstance(m, QuantizedLinear) and m._packed is not None]):
        assert torch.equal(a._packed.weight, b._packed.weight) and torch.equal(a._packed.scales, b._packed.scales)
        assert torch.equal(a.qweight, b.qweight)
        assert a._packed.kernel == b._packed.kernel and a._packed.max_rows == b._packed.max_rows
    ids = torch.tensor([[5, 17, 42, 9, 3]])
    with torch.inference_mode():
        assert torch.equal(first(ids), second(ids))


def test_a_ticker_inside_another_takes_the_line_and_the_outer_one_resumes_after_it():
    out = io.StringIO()
    with progress.ticker("loading", every=0.01, stream=out) as outer:
        time.sleep(0.05)
        before = outer.ticks
        with progress.ticker("building", every=0.01, stream=out) as inner:
            time.sleep(0.1)
            during = outer.ticks
        time.sleep(0.05)
    text = out.getvalue()
    assert inner.ticks >= 2 and during - before <= 1 and outer.ticks > during   # the outer one paused meanwhile
    assert "\nbuilding..." in text and "building... done (" in text and text.endswith(")\n")
    assert text.rindex("loading... done (") > text.index("building... done (")
    assert progress._active == []


def test_the_command_line_ends_at_once_with_its_code_while_a_background_compile_runs():
    assert startup.exit_code(3) == 3                       # nothing compiling: the usual SystemExit
    code = ("import time; from cs336_inference.workshop import startup; "
            "step = startup.BackgroundCompile(len, len, lambda: (lambda: time.sleep(60))).start(); "
            "print('answered', flush=False); raise SystemExit(startup.exit_code(3))")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3 and out.stdout == "answered\n" and time.monotonic() - t0 < 50


def test_a_quiet_ticker_says_nothing_about_quick_work_and_speaks_up_after_its_quiet_time():
    out = io.StringIO()
    with pytest.raises(ValueError), progress.ticker("loading gpt-17", every=0.5, stream=out, quiet_for=0.3):
        raise ValueError("unknown model")
    assert out.getvalue() == "" and progress._active == []
    with progress.ticker("loading", every=0.05, stream=out, quiet_for=0.02) as t:
        time.sleep(0.2)
    assert t.shown and out.getvalue().startswith("loading...") and "loading... done (" in out.getvalue()
    with pytest.raises(ValueError, match="quiet_for"):
        progress.Ticker("x", every=1, quiet_for=2)


def test_a_quiet_outer_ticker_waits_for_the_inner_one_to_end_before_it_speaks():
    out = io.StringIO()
    with progress.ticker("loading", every=0.05, stream=out, quiet_for=0.05):
        with progress.ticker("building", every=0.05, stream=out):
            time.sleep(0.2)
        time.sleep(0.15)
    text = out.getvalue()
    assert text.startswith("building...") and text.index("building... done (") < text.index("loading...")
    assert text.rstrip("\n").splitlines()[-1].startswith("loading... done (")


def test_generate_answers_a_short_question_eagerly_without_compiling(capsys, monkeypatch):
    from cs336_inference import cli

    monkeypatch.setattr(cli, "compiled_decode_step", lambda model: pytest.fail("compiled for a short answer"))
    n = startup.SHORT_ANSWER_TOKENS - 1
    assert cli.main(["generate", "--model", "target", "--prompt", "Once upon a time", "--max-new-tokens", str(n)]) == 0
    assert "eager decode (a short answer)" in capsys.readouterr().err
