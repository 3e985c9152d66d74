"""The Hugging Face peer computes our model's function (same logits, same greedy tokens), and the
generation benchmark runs end to end. Both need optional pieces: transformers (the `[peer]` extra)
for the first; the bench smoke run is slow."""

import json

import pytest
import torch

import adapters

CFG = dict(vocab_size=97, context_length=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=96)


@pytest.mark.parametrize("tied", [False, True])
def test_peer_computes_the_same_logits_and_greedy_tokens(tied):
    pytest.importorskip("transformers", reason='the Hugging Face peer needs: pip install -e ".[peer]"')
    from cs336_inference.workshop.peers import hf_peer as peer

    model = adapters.make_model(adapters.make_config(**CFG, tie_embeddings=tied), seed=0).eval()
    hf = peer.hf_llama_from(model)
    ids = torch.randint(0, 97, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, adapters.run_model(model, ids), rtol=0, atol=1e-4)
    ours = adapters.run_generate(model, ids.tolist(), 16).tokens
    theirs = peer.hf_greedy(hf, ids, 16)
    for b in range(2):   # equal, or first differing where our top two logits tie within rounding
        if theirs[b] != ours[b]:
            t = next(i for i, (x, y) in enumerate(zip(ours[b], theirs[b])) if x != y)
            seq = torch.tensor([ids[b].tolist() + ours[b][:t]])
            with torch.no_grad():
                top2 = adapters.run_model(model, seq)[0, -1].topk(2).values
            assert float(top2[0] - top2[1]) < 1e-4, f"sequence {b} differs at step {t} without a near-tie"
    step = peer.hf_decode_step_fn(hf, 2, context=8)
    assert step().shape == (2, 97)


def test_peer_refuses_models_it_cannot_express():
    from cs336_inference.workshop.peers import hf_peer as peer

    window = adapters.make_model(adapters.make_config(**CFG, sliding_window=4), seed=0)
    if not peer.transformers_available():
        with pytest.raises(ImportError, match="peer"):
            peer.hf_llama_from(window)
        return
    with pytest.raises(ValueError, match="sliding window"):
        peer.hf_llama_from(window)
    quantized = adapters.run_quantize_model(adapters.make_model(adapters.make_config(**CFG)), "rtn", bits=8)
    with pytest.raises(ValueError, match="full-precision"):
        peer.hf_llama_from(quantized)


def test_weight_bytes_per_step_counts_what_decode_reads():
    from cs336_inference.accounting.model_roofline import weight_bytes_per_step

    model = adapters.make_model(adapters.make_config(**{**CFG, "vocab_size": 96}), seed=0)  # 96: int4 kernel rows
    expected = sum(p.nbytes for n, p in model.named_parameters() if not n.startswith("token_embeddings"))
    assert weight_bytes_per_step(model) == expected
    assert weight_bytes_per_step(adapters.run_fuse_projections(model)) == expected
    q = adapters.run_quantize_model(model, "rtn", bits=4, group_size=32, quantize_lm_head=True)
    packed = sum(m.packed_weight().nbytes for m in q.modules() if hasattr(m, "packed_weight"))
    norms = sum(p.nbytes for n, p in q.named_parameters() if "ln" in n)
    assert weight_bytes_per_step(q) == packed + norms


@pytest.mark.slow
def test_bench_generation_quick_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("CS336_FIGURES", str(tmp_path))
    from cs336_inference.workshop.benchmarks.generation import bench_generation

    result = bench_generation(quick=True, device="cpu")
    data = json.loads((tmp_path / "generation_quick.json").read_text())
    assert (tmp_path / "generation_quick.png").exists()
    variants = {(r["variant"], r["batch"]) for r in data["rows"]}
    assert {(v, b) for v in ("fp32", "bf16", "int8", "int4") for b in (1, 8)} <= variants
    assert result["greedy_fast_equals_plain"] is True
    assert result.get("greedy_equals_peer", True) is True
    assert all(r["ms_per_step"] > 0 for r in data["rows"])
    assert set(data["anatomy"]) == {"fp32", "bf16"}   # a quick run profiles the eager steps (no compiling)


def test_each_timing_is_paired_with_the_bandwidth_sampled_right_beside_it():
    """The host's bandwidth swings within seconds, so `bench generation` samples it just before and just
    after every timing, and a row's fraction is the median of per-round ratios, not a ratio of medians."""
    from cs336_inference.workshop.benchmarks.generation import _time_rounds

    events, bandwidths = [], iter([10.0, 30.0, 50.0, 70.0, 1.0, 3.0, 5.0, 7.0])

    def probe():
        events.append("probe")
        return next(bandwidths)

    def maker(name):
        def make():
            events.append(f"make {name}")
            return lambda: events.append(name)
        return make

    out = _time_rounds({"a": maker("a"), "b": maker("b")}, torch.device("cpu"), rounds=2, steps=3, probe=probe)
    one = ["make a", "probe", *["a"] * 5, "probe", "make b", "probe", *["b"] * 5, "probe"]   # 2 warm-up + 3 timed
    assert events == one + one
    assert [b for _, b in out["a"]] == [20.0, 2.0] and [b for _, b in out["b"]] == [60.0, 6.0]
    assert all(t > 0 for pairs in out.values() for t, _ in pairs)
    assert _time_rounds({"a": maker("a")}, torch.device("cpu"), rounds=1, steps=1)["a"][0] > 0   # no probe: seconds
    # 100 bytes in rounds of (1 s, 100 B/s), (2 s, 10 B/s), (4 s, 10 B/s): each round at 1.0, 5.0 and 2.5 of its
    # bandwidth, median 2.5; the ratio of the medians (100 B / 2 s over 10 B/s) would say 5.0
    from cs336_inference.workshop.benchmarks.base import fraction_of_bandwidth

    assert fraction_of_bandwidth(100, [(1.0, 100.0), (2.0, 10.0), (4.0, 10.0)]) == 2.5
