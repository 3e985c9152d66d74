import pytest
import torch
from adapters import make_config, make_kv_cache, make_model, run_model
from reference_model import ref_forward

MHA = dict(vocab_size=257, context_length=48, d_model=32, num_layers=2, num_heads=4, num_kv_heads=4, d_ff=48)
GQA = {**MHA, "num_kv_heads": 2}
MQA = {**MHA, "num_kv_heads": 1}


@pytest.mark.parametrize("kw", [MHA, GQA, MQA], ids=["mha", "gqa", "mqa"])
def test_full_forward_matches_naive_reference(kw):
    cfg = make_config(**kw)
    model = make_model(cfg)
    x = torch.randint(0, cfg.vocab_size, (2, 13))
    with torch.no_grad():
        got = run_model(model, x)
    want = ref_forward(model.state_dict(), cfg, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kw", [MHA, GQA, MQA], ids=["mha", "gqa", "mqa"])
def test_prefill_then_decode_equals_full_forward(kw):
    cfg = make_config(**kw)
    model = make_model(cfg)
    B, P, D = 3, 9, 7
    x = torch.randint(0, cfg.vocab_size, (B, P + D))
    with torch.no_grad():
        full = run_model(model, x)
        cache = make_kv_cache(model, B)
        steps = [run_model(model, x[:, :P], cache)]
        for t in range(P, P + D):
            steps.append(run_model(model, x[:, t:t + 1], cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    assert cache.length == P + D


def test_gqa_equals_mha_with_repeated_kv_weights():
    cfg_gqa = make_config(**GQA)
    gqa = make_model(cfg_gqa)
    G, H = cfg_gqa.num_heads // cfg_gqa.num_kv_heads, cfg_gqa.d_model // cfg_gqa.num_heads
    state = {}
    for name, w in gqa.state_dict().items():
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            # (K*H, D) -> (K, H, D) -> repeat each head G times consecutively -> (N*H, D)
            w = w.reshape(-1, H, w.shape[-1]).repeat_interleave(G, dim=0).reshape(-1, w.shape[-1])
        state[name] = w
    mha = make_model(make_config(**MHA))
    mha.load_state_dict(state)
    x = torch.randint(0, 257, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(run_model(gqa, x), run_model(mha, x), atol=1e-5, rtol=1e-5)


def test_left_padded_batch_matches_each_sequence_alone():
    cfg = make_config(**GQA)
    model = make_model(cfg)
    a, b = torch.randint(1, 257, (5,)), torch.randint(1, 257, (9,))
    batch = torch.stack([torch.cat([torch.zeros(4, dtype=torch.long), a]), b])
    pad = torch.tensor([4, 0])
    with torch.no_grad():
        got = run_model(model, batch, pad=pad)
        torch.testing.assert_close(got[0, 4:], run_model(model, a[None])[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(got[1], run_model(model, b[None])[0], atol=1e-5, rtol=0)
        assert torch.isfinite(got).all()


def test_one_dim_input_gives_two_dim_logits():
    model = make_model(make_config(**MHA))
    with torch.no_grad():
        assert run_model(model, torch.tensor([1, 2, 3])).shape == (3, 257)


@pytest.mark.parametrize("bad, exc, match", [
    (torch.tensor([[1, 2, 300]]), ValueError, "vocab_size"),
    (torch.tensor([[1, -1]]), ValueError, "vocab_size"),
    (torch.tensor([[1.0, 2.0]]), TypeError, "integer dtype"),
    (torch.zeros(1, 0, dtype=torch.long), ValueError, "non-empty"),
    (torch.zeros(1, 49, dtype=torch.long), ValueError, "context_length"),
    ([1, 2, 3], TypeError, "torch.Tensor"),
    (torch.zeros(1, 2, 3, dtype=torch.long), ValueError, "shape"),
])
def test_forward_rejects_bad_token_ids(bad, exc, match):
    model = make_model(make_config(**MHA))
    with pytest.raises(exc, match=match):
        run_model(model, bad)


def test_rope_buffers_are_not_in_state_dict_and_keys_match_cs336():
    model = make_model(make_config(**GQA))
    keys = set(model.state_dict())
    expected = {"token_embeddings.weight", "ln_final.weight", "lm_head.weight"}
    for i in range(2):
        expected |= {f"layers.{i}.attn.{p}_proj.weight" for p in ("q", "k", "v", "output")}
        expected |= {f"layers.{i}.ffn.w{j}.weight" for j in (1, 2, 3)}
        expected |= {f"layers.{i}.ln1.weight", f"layers.{i}.ln2.weight"}
    assert keys == expected
    assert model.state_dict()["layers.0.attn.k_proj.weight"].shape == (2 * 8, 32)
