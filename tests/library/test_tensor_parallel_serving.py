"""The serving engine over tensor-parallel ranks: real processes on 127.0.0.1 (gloo), against the one-process
engine run here, in the test's own process, on the same unsharded weights and the same trace."""

import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from adapters import make_config, make_model

from cs336_inference.generation.sampling_params import SamplingParams
from cs336_inference.parallel import RankFailedError, launch
from cs336_inference.parallel.engine import TensorParallelRunner, serve_tensor_parallel, sharded_engine
from cs336_inference.serving import Engine
from cs336_inference.serving.request import Request
from smollm2_reference import requires_smollm2

# the toy target's shape: 6 query heads over 2 key/value heads
TOY = dict(vocab_size=257, context_length=96, d_model=48, num_layers=2, num_heads=6, num_kv_heads=2, d_ff=64)
OPTIONS = dict(block_size=4, num_blocks=48, max_num_seqs=3, max_num_batched_tokens=24, chunked_prefill=True)


def _unit_cost(batch) -> float:
    """A fixed cost per step: the simulated clock, hence every step's batch, is the same in both runs."""
    return 0.01


def _trace() -> list[Request]:
    g = torch.Generator().manual_seed(1)
    shapes = [(7, 12, 0.0, SamplingParams(max_tokens=12)), (20, 8, 0.0, SamplingParams(max_tokens=8)),
              (3, 10, 0.015, SamplingParams(max_tokens=10, n=2, temperature=1.0, seed=3)),   # a fork: copy-on-write
              (33, 5, 0.03, SamplingParams(max_tokens=5))]                                  # chunked: > 24 tokens
    return [Request(f"r{i}", tuple(torch.randint(0, TOY["vocab_size"], (n,), generator=g).tolist()), m, t, params)
            for i, (n, m, t, params) in enumerate(shapes)]


def _recording(runner, logits: list) -> None:
    """Keep every step's logits and its number of prefills (wrapping this runner instance's `execute`)."""
    execute = runner.execute

    def record(batch, manager):
        out = execute(batch, manager)
        logits.append((len(batch.prefills), out.clone()))
        return out
    runner.execute = record


def _serve_rank(config, state) -> dict:
    engine, runner = sharded_engine((config, state), step_time=_unit_cost, **OPTIONS)
    logits = []
    if engine is None:
        runner.follow()
        result = None
    else:
        _recording(runner, logits)
        try:
            result = engine.run(_trace())
        finally:
            runner.stop()
    pools = [None] * dist.get_world_size()
    dist.all_gather_object(pools, sum(layer.nbytes for layer in runner.cache.unique_layers()))
    return {"tokens": result and [o.tokens for o in result.outputs], "logits": logits, "pool_bytes": pools,
            "communication": runner.communication(), "steps": len(runner.steps)}


def _assert_same_steps(got: list, want: list) -> None:
    """The ranks' steps against one process's: the same kinds (prefills per step), decode-only steps and steps
    with a prefill among them, and every step's logits within 1e-4."""
    kinds = [n for n, _ in want]
    assert kinds == [n for n, _ in got]
    assert 0 in kinds and any(kinds), "the trace must have decode-only steps and steps with a prefill"
    for step, ((n, g), (_, w)) in enumerate(zip(got, want)):
        err = (g - w).abs().max().item()
        assert err <= 1e-4, f"step {step} ({'prefill' if n else 'decode'}): max |delta| = {err}"


@pytest.fixture(scope="module")
def served():
    model = make_model(make_config(**TOY))
    return model, launch(_serve_rank, 2, model.config, model.state_dict(), timeout_s=120)


def test_tp2_engine_serves_the_same_tokens_and_logits_as_one_process(served):
    model, got = served
    engine, want_logits = Engine(model, step_time=_unit_cost, **OPTIONS), []
    _recording(engine.runner, want_logits)
    want = engine.run(_trace())
    assert got["tokens"] == [o.tokens for o in want.outputs]
    assert [len(t) for t in got["tokens"]] == [1, 1, 2, 1]
    _assert_same_steps(got["logits"], want_logits)


def _serve_and_record(source, requests, options) -> dict:
    """On each rank: the engine over `source` sharded across the ranks; rank 0 serves `requests` and
    returns its output tokens and every step's (number of prefills, logits)."""
    engine, runner = sharded_engine(source, dtype=torch.float32, step_time=_unit_cost, **options)
    if engine is None:
        runner.follow()
        return None
    logits = []
    _recording(runner, logits)
    try:
        result = engine.run(requests)
    finally:
        runner.stop()
    return {"tokens": [o.tokens for o in result.outputs], "logits": logits}


@pytest.mark.slow
@requires_smollm2
def test_tp3_smollm2_engine_serves_the_same_tokens_and_logits_as_one_process():
    import cs336_inference
    from cs336_inference.model import load_tokenizer
    tokenizer = load_tokenizer("smollm2-135m")
    texts = [("The capital of France is", 4, 0.0),
             ("Once upon a time, in a small village by the sea, there lived an old fisherman who", 3, 0.0),  # chunked
             ("Water boils at", 4, 0.02)]                                   # arrives while the others decode
    requests = [Request(f"r{i}", tuple(tokenizer.encode(text)), m, t, SamplingParams(max_tokens=m))
                for i, (text, m, t) in enumerate(texts)]
    options = dict(block_size=8, num_blocks=16, max_num_seqs=3, max_num_batched_tokens=12, chunked_prefill=True)
    got = launch(_serve_and_record, 3, "smollm2-135m", requests, options, timeout_s=300)
    model = cs336_inference.load_pretrained("smollm2-135m", dtype=torch.float32)
    assert model.dtype == torch.float32 and model.config.num_heads % 3 == 0
    engine, want_logits = Engine(model, step_time=_unit_cost, **options), []
    _recording(engine.runner, want_logits)
    want = engine.run(requests)
    assert got["tokens"] == [o.tokens for o in want.outputs]
    assert max(s.num_tokens for s in want.steps) <= 12 < max(len(r.prompt) for r in requests), "a chunked prefill"
    _assert_same_steps(got["logits"], want_logits)
    assert not _tp_children()


def test_each_rank_holds_half_the_paged_kv_pool_and_collectives_are_timed_per_phase(served):
    model, got = served
    full = Engine(model, **OPTIONS).runner.cache
    full_bytes = sum(layer.nbytes for layer in full.unique_layers())
    assert full_bytes == 2 * TOY["num_layers"] * OPTIONS["num_blocks"] * OPTIONS["block_size"] * 2 * 8 * 4
    assert got["pool_bytes"] == [full_bytes // 2] * 2
    comm = got["communication"]
    assert comm["prefill"]["steps"] > 0 and comm["decode"]["steps"] > 0
    assert comm["prefill"]["steps"] + comm["decode"]["steps"] == got["steps"] == len(got["logits"])
    for phase in ("prefill", "decode"):
        assert comm[phase]["all_reduce_s"] > 0 and comm[phase]["broadcast_s"] > 0


def _die_on_step_two(config, state) -> None:
    engine, runner = sharded_engine((config, state), **OPTIONS)
    if engine is None:
        run_step = runner._run_step

        def run_then_die(step_inputs, seconds):
            if len(runner.steps) == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return run_step(step_inputs, seconds)
        runner._run_step = run_then_die
        runner.follow()
    else:
        try:
            engine.run(_trace())
        finally:
            runner.stop()


def _tp_children():
    return [p for p in multiprocessing.active_children() if p.name.startswith("tp-rank")]


def test_a_rank_killed_while_serving_is_named_and_every_rank_stops():
    model = make_model(make_config(**TOY))
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 failed: killed by signal SIGKILL") as info:
        launch(_die_on_step_two, 2, model.config, model.state_dict(), timeout_s=60)
    assert time.monotonic() - start < 30
    assert info.value.rank == 1
    assert not _tp_children()


def test_runner_and_serve_refuse_bad_input_before_starting_ranks():
    model = make_model(make_config(**TOY))
    with pytest.raises(TypeError, match="needs a sharded model"):
        TensorParallelRunner(model, 8, 4)
    with pytest.raises(ValueError, match=r"tensor parallel size 4 .*num_heads=6"):
        serve_tensor_parallel((model.config, model.state_dict()), _trace(), 4)
    with pytest.raises(TypeError, match=r"model must be a pretrained name or \(ModelConfig, state_dict\)"):
        serve_tensor_parallel(model, _trace(), 2)
    assert not _tp_children()


def test_bench_inference_tensor_parallel_refuses_bad_sizes_before_starting_ranks():
    from cs336_inference.workshop.benchmarks.inference import BENCHMARK
    with pytest.raises(ValueError, match=r"tensor parallel size 4 .*num_heads=6"):
        BENCHMARK(quick=True, device="cpu", tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be an int >= 2"):
        BENCHMARK(quick=True, device="cpu", tensor_parallel_size=1)
    with pytest.raises(ValueError, match="give one of endpoint, tensor_parallel_size"):
        BENCHMARK(quick=True, device="cpu", tensor_parallel_size=2, endpoint="http://127.0.0.1:9/v1")
    assert not _tp_children()


@pytest.mark.slow
def test_bench_inference_tensor_parallel_reports_communication_beside_one_device(tmp_path, monkeypatch):
    import json

    import cs336_inference
    from cs336_inference.serving.workload import Workload
    from cs336_inference.workshop.benchmarks.inference import BENCHMARK
    from cs336_inference.workshop.benchmarks.inference_sweep import SweepConfig
    monkeypatch.setenv("CS336_FIGURES", str(tmp_path))
    tiny = Workload("chat", prompt_len=(8, 16), output_len=6, concurrency=2, num_requests=3)
    sweep = SweepConfig(presets={"chat": tiny}, warmup=Workload("warmup", (8, 8), 2, 2, 2))
    result = BENCHMARK(quick=True, device="cpu", tensor_parallel_size=2, sweep=sweep, progress=False)
    one, two = result["rows"]
    assert (one["ranks"], two["ranks"]) == (1, 2) and one["workload"] == two["workload"] == "chat"
    assert one["completed"] == two["completed"] == 3
    assert one["output_tokens"] == two["output_tokens"] == 3 * 6   # no stop token in a tiny run
    assert one["communication_s"] == 0 and one["decode_communication_share"] == 0
    assert two["communication_prefill_s"] > 0 and two["communication_decode_s"] > 0
    assert two["communication_s"] == pytest.approx(two["communication_prefill_s"] + two["communication_decode_s"])
    assert 0 < two["decode_communication_share"] < 1
    assert two["decode_steps"] > 0 and two["prefill_steps"] > 0
    # beside it, the ring formula: 2L all-reduces of each decode step's tokens' fp32 activations per step
    config = cs336_inference.load_pretrained("target").config
    L, D, lat, bw = config.num_layers, config.d_model, two["loopback_latency_s"], two["loopback_bandwidth_Bps"]
    assert lat > 0 and bw > 0
    assert two["predicted_decode_all_reduce_s"] >= two["decode_steps"] * 2 * L * (2 * lat)   # p = 2: 2 ring steps
    assert two["predicted_decode_all_reduce_s"] <= two["decode_steps"] * 2 * L * (2 * lat + 2 * D * 4 / bw)   # B <= 2
    saved = json.loads(next(tmp_path.rglob("inference_tp2*.json")).read_text())
    assert saved["rows"][1]["communication_decode_s"] == pytest.approx(two["communication_decode_s"])
    assert not _tp_children()


def _children_of(pid: int) -> list[int]:
    """Every descendant of pid, from /proc (ranks, and whatever they started)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, frontier = [], [pid]
    while frontier:
        kids = [c for c, p in parents.items() if p in frontier]
        out += kids
        frontier = kids
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_serve_over_two_ranks_answers_and_sigint_stops_every_rank():
    import json
    import urllib.request

    from cs336_inference.serving.http.launch import ServerProcess
    server = ServerProcess.start("target", "--tensor-parallel-size", "2", "--max-num-seqs", "4", "--num-blocks", "64")
    try:
        server.wait_ready(timeout=120)
        ranks = _children_of(server.process.pid)
        assert len([p for p in ranks if _alive(p)]) >= 2, server.log()
        body = json.dumps({"model": "target", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}).encode()
        request = urllib.request.Request(server.v1 + "/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = json.loads(response.read())
        assert answer["usage"]["completion_tokens"] >= 1 and answer["choices"][0]["text"]
        server.process.send_signal(signal.SIGINT)
        server.process.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in ranks if _alive(p)], server.log()
    finally:
        server.stop()


@pytest.mark.slow
def test_chat_session_over_two_ranks_answers_as_one_process_and_close_stops_every_rank():
    from types import SimpleNamespace

    import cs336_inference
    from cs336_inference.model import load_tokenizer
    from cs336_inference.parallel.chat import TensorParallelStreams
    from cs336_inference.serving import ChatSession
    tokenizer, model = load_tokenizer("target"), cs336_inference.load_pretrained("target")
    options = dict(block_size=16, max_num_seqs=1, watermark_blocks=0, num_blocks=16)
    one = ChatSession(model, tokenizer, max_seq_len=256)
    with TensorParallelStreams("target", 2, timeout_s=120, **options) as streams:
        session = ChatSession(SimpleNamespace(config=model.config), tokenizer, max_seq_len=256, streams=streams)
        for text in ("Once upon a time", "and then"):
            got = "".join(session.send(text, max_new_tokens=12))
            assert got   # (the toy target may answer in spaces)
            assert got == "".join(one.send(text, max_new_tokens=12))
        assert len(_tp_children()) == 2
        assert session.history[1].reused_tokens > 0     # the first turn's blocks, from rank 0's prefix cache
        for s in (session, one):                         # stopped after its first piece: aborted on rank 0
            stopped = s.send("Tell me more", max_new_tokens=40)
            next(stopped)
            stopped.close()
        assert session.messages == one.messages and session.history[2].stopped
        assert "".join(session.send("ok", max_new_tokens=8)) == "".join(one.send("ok", max_new_tokens=8))
    deadline = time.monotonic() + 10
    while _tp_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _tp_children()


def test_chat_and_serve_cli_refuse_before_starting_ranks(capsys):
    from cs336_inference import cli
    assert cli.main(["chat", "--model", "target", "--tensor-parallel-size", "2"]) == 2
    assert "target has no chat template" in capsys.readouterr().err
    assert cli.main(["serve", "--model", "target", "--tensor-parallel-size", "4"]) == 2
    assert "tensor parallel size 4 must divide num_heads=6" in capsys.readouterr().err
    assert not _tp_children()
