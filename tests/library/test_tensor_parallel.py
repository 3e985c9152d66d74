"""Tensor parallelism over torch.distributed: real processes on 127.0.0.1 (gloo), compared with one process.

The references are computed here, in the test's own process, by the unsharded model; the bytes each
rank holds are counted here from the parameter names, not by the library's helper.
"""

import multiprocessing
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from adapters import make_config, make_model

from cs336_inference.generation import generate
from cs336_inference.parallel import (RankFailedError, check_tensor_parallel, launch, shard_model,
                                      sharded_parameter_bytes, tensor_parallel)

# the toy target's shape: 6 query heads over 2 key/value heads
TOY = dict(vocab_size=257, context_length=96, d_model=48, num_layers=2, num_heads=6, num_kv_heads=2, d_ff=64)
PROMPT = torch.tensor([[5, 17, 200, 3, 99, 42, 7], [1, 2, 3, 4, 5, 6, 7]])
DECODE = torch.tensor([[11, 12, 13], [21, 22, 23]])    # fed one column per decode step
NEW_TOKENS = 64


def _projection_bytes(model) -> int:
    """Bytes of q/k/v/output and w1/w2/w3, counted from the state-dict names."""
    names = ("q_proj", "k_proj", "v_proj", "output_proj", "w1", "w2", "w3")
    return sum(p.nbytes for n, p in model.named_parameters() if n.split(".")[-2] in names)


def _prefill_and_decode(model, cache, timer=None):
    def phase(name):
        return timer.phase(name) if timer is not None else torch.no_grad()
    with torch.no_grad():
        with phase("prefill"):
            logits = [model(PROMPT, cache)]
        with phase("decode"):
            for t in range(DECODE.shape[1]):
                logits.append(model(DECODE[:, t:t + 1], cache))
    return logits


def _toy_rank(state: dict) -> dict:
    model = make_model(make_config(**TOY))
    model.load_state_dict(state)
    tensor_parallel(model)
    cache = model.new_cache(PROMPT.shape[0], 32)
    logits = _prefill_and_decode(model, cache, model.tp_timer)
    with torch.no_grad():
        tokens = generate(model, PROMPT[0], NEW_TOKENS).tokens
    mine = {"weight_bytes": _projection_bytes(model), "helper_bytes": sharded_parameter_bytes(model),
            "cache_bytes": cache.nbytes, "comm_s": model.tp_timer.seconds(), "calls": dict(model.tp_timer.calls)}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {"logits": logits, "tokens": tokens, "ranks": every}


@pytest.fixture(scope="module")
def toy():
    torch.manual_seed(0)
    model = make_model(make_config(**TOY))
    result = launch(_toy_rank, 2, model.state_dict(), timeout_s=120)
    return model, result


def test_tp2_prefill_and_decode_logits_equal_one_process(toy):
    model, result = toy
    want = _prefill_and_decode(model, model.new_cache(PROMPT.shape[0], 32))
    assert len(result["logits"]) == len(want) == 1 + DECODE.shape[1]
    for step, (got, ref) in enumerate(zip(result["logits"], want)):
        err = (got - ref).abs().max().item()
        assert err <= 1e-4, f"step {step} ({'prefill' if step == 0 else 'decode'}): max |delta| = {err}"


def test_tp2_greedy_tokens_identical(toy):
    model, result = toy
    with torch.no_grad():
        want = generate(model, PROMPT[0], NEW_TOKENS).tokens
    assert result["tokens"] == want
    assert len(want[0]) == NEW_TOKENS


def test_each_rank_holds_half_the_weights_and_the_kv_cache(toy):
    model, result = toy
    full_weights = _projection_bytes(model)
    full_cache = model.new_cache(PROMPT.shape[0], 32).nbytes
    for rank, r in enumerate(result["ranks"]):
        assert r["weight_bytes"] * 2 == full_weights, f"rank {rank}"
        assert r["helper_bytes"] == r["weight_bytes"], f"rank {rank}"
        assert r["cache_bytes"] * 2 == full_cache, f"rank {rank}"


def test_collective_time_is_recorded_per_phase(toy):
    _, result = toy
    for r in result["ranks"]:
        # two all-reduces per layer per forward: 1 prefill forward, 3 decode forwards before generate
        assert r["calls"]["prefill"] == 2 * TOY["num_layers"]
        assert r["calls"]["decode"] == 2 * TOY["num_layers"] * DECODE.shape[1]
        assert r["comm_s"]["prefill"] > 0 and r["comm_s"]["decode"] > 0


def test_bad_world_size_names_the_sizes_and_leaves_the_model_unchanged():
    torch.manual_seed(0)
    model = make_model(make_config(**TOY))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"tensor parallel size 4 .*num_heads=6.*num_kv_heads=2.*d_ff=64"):
        shard_model(model, 0, 4)
    with pytest.raises(ValueError, match=r"not divisible by 3: num_kv_heads=2, d_ff=64 \(sizes that work: \[1, 2\]\)"):
        check_tensor_parallel(model.config, 3)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    check_tensor_parallel(model.config, 2)   # the toy target runs at 2


def _kill_rank_one() -> None:
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(4))   # rank 0 waits here for a rank that is gone
    dist.all_reduce(torch.ones(4))


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    dist.all_reduce(torch.ones(4))


def _tp_children():
    return [p for p in multiprocessing.active_children() if p.name.startswith("tp-rank")]


@pytest.mark.parametrize("fn, why", [(_kill_rank_one, "killed by signal SIGKILL"),
                                     (_raise_on_rank_one, "ValueError: rank one refuses")], ids=["killed", "raises"])
def test_a_failed_rank_is_named_and_every_rank_stops(fn, why):
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 failed") as info:
        launch(fn, 2, timeout_s=60)
    assert time.monotonic() - start < 30
    assert info.value.rank == 1 and why in str(info.value)
    assert not _tp_children()


def _smollm2_rank(prompt: torch.Tensor) -> list:
    import cs336_inference
    model = cs336_inference.load_pretrained("smollm2-135m")
    tensor_parallel(model)
    return _logits_with_cache(model, prompt)


def _logits_with_cache(model, prompt):
    cache = model.new_cache(1, 32)
    with torch.no_grad():
        out = [model(prompt, cache)]
        token = out[0][:, -1:].argmax(-1)
        for _ in range(2):
            out.append(model(token, cache))
            token = out[-1][:, -1:].argmax(-1)
    return out


@pytest.mark.slow
def test_tp3_smollm2_logits_equal_one_process():
    import cs336_inference
    prompt = torch.tensor([[504, 3458, 282, 4649, 314, 7042, 30]])   # token ids of a short English sentence
    got = launch(_smollm2_rank, 3, prompt, timeout_s=500)
    model = cs336_inference.load_pretrained("smollm2-135m")
    assert model.dtype == torch.float32
    want = _logits_with_cache(model, prompt)
    for step, (g, w) in enumerate(zip(got, want)):
        err = (g - w).abs().max().item()
        assert err <= 1e-4, f"step {step}: max |delta| = {err}"


def test_communication_accounting_against_a_hand_computation():
    from cs336_inference.accounting import (allreduce_bytes_per_step, ring_allreduce_seconds,
                                            tensor_parallel_step_seconds)
    # SmolLM2-135M in bf16: 30 layers, D = 576: 2 all-reduces * 30 * 576 * 2 bytes per decoded token
    assert allreduce_bytes_per_step(30, 576) == 69_120
    assert allreduce_bytes_per_step(30, 576, batch_size=4, num_tokens=8, bytes_per_element=4) == 69_120 * 4 * 8 * 2
    # ring over 4 ranks: 6 steps of n/4 bytes: 1.5 * 1e6 / 1e9 + 6 * 10 us
    assert ring_allreduce_seconds(1e6, 4, bandwidth=1e9, latency=1e-5) == pytest.approx(1.5e-3 + 6e-5)
    assert ring_allreduce_seconds(1e6, 1, bandwidth=1e9, latency=1e-5) == 0
    # the toy at p = 2, fp32, one token: 4 all-reduces of 48 * 4 = 192 bytes, each 192 / 1e8 + 2 * 100 us
    assert tensor_parallel_step_seconds(2, 48, 2, bandwidth=1e8, latency=1e-4, bytes_per_element=4) == \
        pytest.approx(4 * (192 / 1e8 + 2e-4))
    with pytest.raises(ValueError, match="world_size"):
        ring_allreduce_seconds(1e6, 0, bandwidth=1e9)
    with pytest.raises(ValueError, match="bandwidth"):
        ring_allreduce_seconds(1e6, 2, bandwidth=0)


def test_bench_tensor_parallel_refuses_a_bad_size_and_model_before_starting_ranks():
    from cs336_inference.workshop.benchmarks.tensor_parallel import BENCHMARK
    with pytest.raises(ValueError, match=r"tensor parallel size 4 .*num_heads=6"):
        BENCHMARK(quick=True, device="cpu", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="model='draft'"):
        BENCHMARK(quick=True, device="cpu", model="draft")
    assert not _tp_children()


@pytest.mark.slow
def test_bench_tensor_parallel_reports_communication_beside_the_ring_formula(tmp_path, monkeypatch):
    import json

    from cs336_inference.workshop.benchmarks.tensor_parallel import BENCHMARK
    monkeypatch.setenv("CS336_FIGURES", str(tmp_path))
    BENCHMARK(quick=True, device="cpu")
    assert {"tensor_parallel_quick.json", "tensor_parallel_quick.png"} <= {p.name for p in tmp_path.iterdir()}
    result = json.loads((tmp_path / "tensor_parallel_quick.json").read_text())
    p, L, D = result["tensor_parallel_size"], result["num_layers"], result["d_model"]
    lat, bw = result["loopback_latency_s"], result["loopback_bandwidth_Bps"]
    assert p == 2 and lat > 0 and bw > 0
    for r in result["rows"]:
        B = r["batch"]
        assert r["tp_decode_comm_per_step_s"] > 0 and r["tp_prefill_comm_s"] > 0
        assert r["one_decode_comm_per_step_s"] == 0 and r["one_prefill_comm_s"] == 0
        assert r["bytes_per_decode_step"] == 2 * L * B * D * 4
        # 2L ring all-reduces of B*D fp32 values: 2(p-1)/p * bytes / bw + 2(p-1) * latency each
        message = B * D * 4
        ring = 2 * (p - 1) / p * message / bw + 2 * (p - 1) * lat
        assert r["predicted_decode_comm_s"] == pytest.approx(2 * L * ring)


def test_generate_cli_refuses_a_bad_tensor_parallel_size_before_starting_ranks(capsys):
    from cs336_inference import cli
    assert cli.main(["generate", "--model", "target", "--prompt", "Once", "--tensor-parallel-size", "4"]) == 2
    assert "tensor parallel size 4 must divide num_heads=6, num_kv_heads=2" in capsys.readouterr().err
    assert not _tp_children()


@pytest.mark.slow
def test_generate_cli_over_two_ranks_prints_the_one_process_greedy_answer(capsys):
    import cs336_inference
    from cs336_inference import cli
    from cs336_inference.model import load_tokenizer
    prompt = "Once upon a time"
    assert cli.main(["generate", "--model", "target", "--prompt", prompt, "--max-new-tokens", "16",
                     "--tensor-parallel-size", "2"]) == 0
    out = capsys.readouterr()
    tokenizer = load_tokenizer("target")
    model = cs336_inference.load_pretrained("target")
    with torch.no_grad():
        want = generate(model, tokenizer.encode(prompt), 16, stop_tokens=tokenizer.stop_ids or None).tokens[0]
    assert out.out == tokenizer.decode([t for t in want if t not in tokenizer.stop_ids]) + "\n"
    assert "all-reduces on rank 0" in out.err


def test_shard_model_checks_every_layer_before_changing_any_and_unfuses_first():
    torch.manual_seed(0)
    model = make_model(make_config(**TOY))
    model.layers[1].ffn.w2 = torch.nn.Linear(TOY["d_ff"], TOY["d_model"], bias=True)
    with pytest.raises(TypeError, match=r"layers\.1\.ffn\.w2 is a Linear.*bias-free"):
        shard_model(model, 0, 2)
    assert model.layers[0].attn.num_heads == 6 and model.layers[0].attn.q_proj.weight.shape == (48, 48)
    fused = make_model(make_config(**TOY)).fuse_projections()
    full = {k: v.clone() for k, v in fused.state_dict().items()}
    shard_model(fused, 1, 2)   # rank 1 of 2: the second half of the heads and of d_ff
    H = TOY["d_model"] // TOY["num_heads"]
    attn, ffn = fused.layers[0].attn, fused.layers[0].ffn
    assert torch.equal(attn.q_proj.weight, full["layers.0.attn.q_proj.weight"][3 * H:])
    assert torch.equal(attn.k_proj.weight, full["layers.0.attn.k_proj.weight"][H:])
    assert torch.equal(attn.output_proj.weight, full["layers.0.attn.output_proj.weight"][:, 3 * H:])
    assert torch.equal(ffn.w3.weight, full["layers.0.ffn.w3.weight"][32:])
    assert torch.equal(ffn.w2.weight, full["layers.0.ffn.w2.weight"][:, 32:])
    assert (attn.num_heads, attn.num_kv_heads) == (3, 1)


@pytest.mark.slow
def test_a_plain_script_without_a_main_guard_launches_ranks_once(tmp_path):
    """A notebook exported to .py and run with python has no `if __name__ == "__main__"`: spawn must not
    re-run that script in each rank (each would launch ranks of its own) when fn lives in a module."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "no_guard.py"
    script.write_text("import operator\nfrom cs336_inference.parallel import launch\n"
                      "print('top level ran', flush=True)\n"
                      "print('result', launch(operator.add, 2, 20, 22, timeout_s=60))\n")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["top level ran", "result 42"]
