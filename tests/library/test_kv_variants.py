"""Every attention variant (MHA/GQA/MQA, MLA, sliding window, local/global hybrid, cross-layer sharing)
against a naive reference written here from the papers' equations: per-layer, per-head loops, an
explicit mask per layer, RoPE through complex numbers (reference_model.ref_rope)."""

import pytest
import torch
from adapters import (make_config, make_kv_cache, make_mla_attention, make_model, run_attention_module,
                      run_block, run_model, set_mla_absorb)
from reference_model import ref_attention, ref_rmsnorm, ref_rope

BASE = dict(vocab_size=257, context_length=64, d_model=32, num_layers=4, num_heads=4, d_ff=48)
WINDOW = 5
VARIANTS = {
    "mha": {},
    "gqa": dict(num_kv_heads=2),
    "mqa": dict(num_kv_heads=1),
    "mla": dict(attention_type="mla", kv_lora_rank=12, rope_head_dim=4),
    "mla_qlora": dict(attention_type="mla", kv_lora_rank=12, rope_head_dim=4, q_lora_rank=16),
    "window": dict(num_kv_heads=2, sliding_window=WINDOW),
    "hybrid": dict(num_kv_heads=2, sliding_window=WINDOW, global_every=2),
    "cla": dict(num_kv_heads=2, kv_share_group=2),
    "cla_mla": dict(attention_type="mla", kv_lora_rank=12, rope_head_dim=4, kv_share_group=2),
    "cla_window": dict(sliding_window=WINDOW, kv_share_group=2),
    "window_sinks": dict(num_kv_heads=2, sliding_window=WINDOW, attention_sinks=2),
}


def ref_layer_window(cfg, i):
    """Layer i is local unless it is the last of a block of `global_every` layers."""
    if cfg.sliding_window is None or (cfg.global_every and (i + 1) % cfg.global_every == 0):
        return None
    return cfg.sliding_window


def ref_allowed(T, window, sinks=0):
    """Causal; with a window, key s is visible to query t iff t - s < window or s < sinks (StreamingLLM)."""
    t, s = torch.arange(T)[:, None], torch.arange(T)[None, :]
    allowed = s <= t
    return allowed if window is None else allowed & ((t - s < window) | (s < sinks))


def ref_variant_forward(state, cfg, token_ids):
    """Full forward (B, T) -> logits (B, T, V) of any variant, no cache, everything spelled out."""
    N, H, L = cfg.num_heads, cfg.d_model // cfg.num_heads, cfg.num_layers
    B, T = token_ids.shape
    pos = torch.arange(T)
    x = state["token_embeddings.weight"][token_ids]
    kv = {}  # layer -> what it computed for its CLA group
    for i in range(L):
        p = f"layers.{i}.attn."
        src = (i // cfg.kv_share_group) * cfg.kv_share_group
        allowed = ref_allowed(T, ref_layer_window(cfg, i), cfg.attention_sinks)
        h = ref_rmsnorm(x, state[f"layers.{i}.ln1.weight"], cfg.norm_eps)
        out = torch.zeros(B, T, N * H)
        if cfg.attention_type == "gqa":
            K = cfg.num_kv_heads
            if i == src:
                kv[i] = (h @ state[p + "k_proj.weight"].T, h @ state[p + "v_proj.weight"].T)
            k, v = kv[src]
            q = h @ state[p + "q_proj.weight"].T
            for b in range(B):
                for n in range(N):
                    j = n // (N // K)
                    qn = ref_rope(q[b, :, n * H:(n + 1) * H], pos, cfg.rope_theta)
                    kn = ref_rope(k[b, :, j * H:(j + 1) * H], pos, cfg.rope_theta)
                    out[b, :, n * H:(n + 1) * H] = ref_attention(qn, kn, v[b, :, j * H:(j + 1) * H], allowed)
        else:  # MLA, DeepSeek-V2 eq. (9)-(19), naive form
            R = cfg.rope_head_dim
            if p + "q_proj.weight" in state:
                q = h @ state[p + "q_proj.weight"].T
            else:
                q = (h @ state[p + "q_down_proj.weight"].T) @ state[p + "q_up_proj.weight"].T
            if i == src:
                kv[i] = (h @ state[p + "kv_down_proj.weight"].T, h @ state[p + "k_rope_proj.weight"].T)
            c, kr = kv[src]
            for b in range(B):
                k_rope = ref_rope(kr[b], pos, cfg.rope_theta)
                for n in range(N):
                    qn = q[b, :, n * (H + R):(n + 1) * (H + R)]
                    qn = torch.cat([qn[:, :H], ref_rope(qn[:, H:], pos, cfg.rope_theta)], -1)
                    kn = torch.cat([c[b] @ state[p + "k_up_proj.weight"][n * H:(n + 1) * H].T, k_rope], -1)
                    vn = c[b] @ state[p + "v_up_proj.weight"][n * H:(n + 1) * H].T
                    out[b, :, n * H:(n + 1) * H] = ref_attention(qn, kn, vn, allowed)
        x = x + out @ state[p + "output_proj.weight"].T
        h = ref_rmsnorm(x, state[f"layers.{i}.ln2.weight"], cfg.norm_eps)
        a, g = h @ state[f"layers.{i}.ffn.w1.weight"].T, h @ state[f"layers.{i}.ffn.w3.weight"].T
        x = x + (a * torch.sigmoid(a) * g) @ state[f"layers.{i}.ffn.w2.weight"].T
    x = ref_rmsnorm(x, state["ln_final.weight"], cfg.norm_eps)
    return x @ state["lm_head.weight"].T


def _model(name, **extra):
    cfg = make_config(**{**BASE, **VARIANTS[name], **extra})
    return cfg, make_model(cfg)


@pytest.mark.parametrize("name", VARIANTS)
def test_full_forward_matches_reference(name):
    cfg, model = _model(name)
    x = torch.randint(0, 257, (2, 14))
    with torch.no_grad():
        got = run_model(model, x)
    want = ref_variant_forward(model.state_dict(), cfg, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4,
                               msg=lambda m: f"{name}: full forward differs from the naive reference\n{m}")


@pytest.mark.parametrize("name", VARIANTS)
def test_prefill_then_decode_equals_full_forward(name):
    """Batch 3, a 12-token prompt (longer than the window of 5), then 14 one-token steps."""
    cfg, model = _model(name)
    B, P, D = 3, 12, 14
    x = torch.randint(0, 257, (B, P + D))
    with torch.no_grad():
        cache = make_kv_cache(model, B, max_seq_len=P + D + 3)
        steps = [run_model(model, x[:, :P], cache)]
        for t in range(P, P + D):
            steps.append(run_model(model, x[:, t:t + 1], cache))
    want = ref_variant_forward(model.state_dict(), cfg, x)
    torch.testing.assert_close(torch.cat(steps, 1), want, atol=1e-5, rtol=1e-4,
                               msg=lambda m: f"{name}: cached decode differs from the reference\n{m}")


@pytest.mark.parametrize("name", ["window", "mla", "hybrid"])
def test_left_padded_cached_batch_matches_each_sequence_alone(name):
    _, model = _model(name)
    a, b = torch.randint(1, 257, (6,)), torch.randint(1, 257, (11,))
    batch = torch.stack([torch.cat([torch.zeros(5, dtype=torch.long), a]), b])
    with torch.no_grad():
        cache, pad = model.new_cache(2, 20), torch.tensor([5, 0])
        first = run_model(model, batch, cache, pad=pad)
        nxt = torch.randint(1, 257, (2, 1))
        second = run_model(model, nxt, cache, pad=pad)
        alone_a = run_model(model, torch.cat([a, nxt[0]])[None])[0]
        alone_b = run_model(model, torch.cat([b, nxt[1]])[None])[0]
    torch.testing.assert_close(first[0, 5:], alone_a[:-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(second[0, 0], alone_a[-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(first[1], alone_b[:-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(second[1, 0], alone_b[-1], atol=1e-5, rtol=0)


# --- MLA ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mla", "mla_qlora", "cla_mla"])
def test_mla_absorbed_decode_equals_naive_decode(name):
    _, model = _model(name)
    x = torch.randint(0, 257, (2, 20))
    logits = {}
    for absorb in (True, False):
        set_mla_absorb(model, absorb)
        with torch.no_grad():
            cache = make_kv_cache(model, 2, 24)
            steps = [run_model(model, x[:, :8], cache)]
            steps += [run_model(model, x[:, t:t + 1], cache) for t in range(8, 20)]
        logits[absorb] = torch.cat(steps, 1)
    torch.testing.assert_close(logits[True], logits[False], atol=1e-5, rtol=1e-5)


def test_mla_cache_holds_only_latent_and_rope_key():
    cfg, model = _model("mla")
    cache = make_kv_cache(model, 2, 10)
    C, R, L = cfg.kv_lora_rank, cfg.rope_head_dim, cfg.num_layers
    assert cache.bytes_per_token == (C + R) * L * 4
    assert cache.nbytes == 2 * 10 * (C + R) * L * 4
    assert "layers.0.attn.k_proj.weight" not in model.state_dict()
    assert model.state_dict()["layers.0.attn.kv_down_proj.weight"].shape == (C, cfg.d_model)


def test_full_rank_mla_expresses_mha_with_a_shared_rope_key():
    """An MHA whose head n has keys [W_K,n h, RoPE(W_KR h)], queries [W_Q,n h, RoPE(W_QR,n h)] and
    values W_V,n h is an MLA with latent C = 2 N H: W_DKV = [W_K; W_V], W_UK = [I 0], W_UV = [0 I]."""
    N, H, R, D, T = 4, 8, 4, 32, 9
    cfg = make_config(**{**BASE, "attention_type": "mla", "kv_lora_rank": 2 * N * H, "rope_head_dim": R})
    g = torch.Generator().manual_seed(1)
    w = {name: torch.randn(shape, generator=g) / D ** 0.5 for name, shape in dict(
        q=(N * H, D), qr=(N * R, D), k=(N * H, D), kr=(R, D), v=(N * H, D), o=(D, N * H)).items()}
    x = torch.randn(2, T, D, generator=g)
    pos = torch.arange(T)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    want = torch.zeros(2, T, N * H)
    for b in range(2):
        k_rope = ref_rope(x[b] @ w["kr"].T, pos, cfg.rope_theta)
        for n in range(N):
            sl, rl = slice(n * H, (n + 1) * H), slice(n * R, (n + 1) * R)
            qn = torch.cat([x[b] @ w["q"][sl].T, ref_rope(x[b] @ w["qr"][rl].T, pos, cfg.rope_theta)], -1)
            kn = torch.cat([x[b] @ w["k"][sl].T, k_rope], -1)
            want[b, :, sl] = ref_attention(qn, kn, x[b] @ w["v"][sl].T, causal)
    want = want @ w["o"].T

    mla = make_mla_attention(cfg)
    eye, zero = torch.eye(N * H), torch.zeros(N * H, N * H)
    q_rows = torch.cat([w["q"].reshape(N, H, D), w["qr"].reshape(N, R, D)], dim=1).reshape(N * (H + R), D)
    mla.load_state_dict({"q_proj.weight": q_rows, "kv_down_proj.weight": torch.cat([w["k"], w["v"]]),
                         "k_rope_proj.weight": w["kr"], "k_up_proj.weight": torch.cat([eye, zero], 1),
                         "v_up_proj.weight": torch.cat([zero, eye], 1), "output_proj.weight": w["o"]})
    with torch.no_grad():
        got = run_attention_module(mla, x, pos, causal[None, None])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


# --- sliding window and hybrids ----------------------------------------------------------------


def test_sliding_window_decoding_past_the_window_keeps_bytes_flat_and_matches_band_mask():
    cfg, model = _model("window")
    B, S_max = 2, 40
    x = torch.randint(0, 257, (B, 36))
    with torch.no_grad():
        cache = make_kv_cache(model, B, S_max)
        bytes0 = cache.nbytes
        steps = [run_model(model, x[:, :3], cache)]
        for t in range(3, 36):
            steps.append(run_model(model, x[:, t:t + 1], cache))
            assert cache.nbytes == bytes0, f"cache grew at step {t}"
        full_global = run_model(make_model(make_config(**{**BASE, "num_kv_heads": 2})), x)
    assert bytes0 == B * WINDOW * cache.bytes_per_token  # the ring holds exactly `window` positions
    want = ref_variant_forward(model.state_dict(), cfg, x)  # full attention with a band mask
    torch.testing.assert_close(torch.cat(steps, 1), want, atol=1e-5, rtol=1e-4)
    # Sanity: within the first window local == global; beyond it they must differ.
    torch.testing.assert_close(want[:, :WINDOW], full_global[:, :WINDOW], atol=1e-5, rtol=1e-4)
    assert (want[:, WINDOW + 2:] - full_global[:, WINDOW + 2:]).abs().max() > 1e-3


def test_attention_sinks_keep_the_first_positions_in_flat_memory():
    cfg, model = _model("window_sinks")
    x = torch.randint(0, 257, (2, 30))
    with torch.no_grad():
        cache = make_kv_cache(model, 2, 40)
        steps = [run_model(model, x[:, :9], cache)]
        steps += [run_model(model, x[:, t:t + 1], cache) for t in range(9, 30)]
        plain = run_model(make_model(make_config(**{**BASE, **VARIANTS["window"]})), x)
    assert cache.nbytes == 2 * (WINDOW + 2) * cache.bytes_per_token  # ring + 2 sink positions
    want = ref_variant_forward(model.state_dict(), cfg, x)
    torch.testing.assert_close(torch.cat(steps, 1), want, atol=1e-5, rtol=1e-4)
    assert (plain[:, WINDOW + 1:] - run_model(model, x)[:, WINDOW + 1:]).abs().max() > 1e-3  # sinks matter
    with pytest.raises(ValueError, match="attention_sinks needs sliding_window"):
        make_config(**{**BASE, "attention_sinks": 2})
    with pytest.raises(ValueError, match="left padding"):
        run_model(model, x[:, :8], model.new_cache(2, 20), pad=torch.tensor([3, 0]))


def test_hybrid_equals_per_layer_composition():
    """Layer by layer: local layers behave as in an all-local model, global ones as in a global model."""
    cfg, hybrid = _model("hybrid")
    state = hybrid.state_dict()
    local = make_model(make_config(**{**BASE, **VARIANTS["window"]}))
    glob = make_model(make_config(**{**BASE, "num_kv_heads": 2}))
    local.load_state_dict(state)
    glob.load_state_dict(state)
    T = 17
    x = torch.randint(0, 257, (2, T))
    pos = torch.arange(T)
    band = ref_allowed(T, WINDOW)[None, None]
    causal = ref_allowed(T, None)[None, None]
    with torch.no_grad():
        h = local.token_embeddings(x)
        for i in range(cfg.num_layers):
            is_global = (i + 1) % 2 == 0
            block = (glob if is_global else local).layers[i]
            h = run_block(block, h, pos, causal if is_global else band, cfg.head_dim)
        composed = local.lm_head(local.ln_final(h))
        got = run_model(hybrid, x)
    torch.testing.assert_close(got, composed, atol=1e-5, rtol=1e-5)
    assert [getattr(b.attn, "window", None) for b in hybrid.layers] == [WINDOW, None, WINDOW, None]


# --- cross-layer attention ---------------------------------------------------------------------


@pytest.mark.parametrize("group", [2, 4])
def test_cla_layers_share_one_cache_object_and_bytes_shrink_by_the_group_size(group):
    _, model = _model("gqa")
    _, shared = _model("gqa", kv_share_group=group)
    base_cache, cache = make_kv_cache(model, 2, 16), make_kv_cache(shared, 2, 16)
    for i in range(4):
        assert cache.layers[i] is cache.layers[i - i % group], f"layer {i} does not use its group's cache"
    assert len({id(layer) for layer in cache.layers}) == 4 // group
    assert cache.nbytes * group == base_cache.nbytes
    assert cache.bytes_per_token * group == base_cache.bytes_per_token
    keys = shared.state_dict()
    assert "layers.0.attn.k_proj.weight" in keys and "layers.1.attn.k_proj.weight" not in keys
