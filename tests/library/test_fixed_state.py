"""Fixed-state layers (BASED linear attention, Mamba-2's SSD) against naive per-token references
written here from each layer's weights; their state cache: the recurrent decode equals the parallel
full forward, bytes do not grow with T, exception safety, padding, rollback; and the MQAR task."""

import math

import pytest
import torch
import torch.nn.functional as F

from adapters import (make_config, make_kv_cache, make_model, make_mqar_task, run_gated_linear_attention,
                      run_model, run_mqar_recall, run_state_bytes, run_taylor_feature_map)

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = dict(vocab_size=50, context_length=64, d_model=32, num_layers=2, num_heads=4, d_ff=64,
            feature_dim=4, state_dim=8)
KINDS = {
    "linear": dict(mixer="linear"),
    "ssd": dict(mixer="ssd"),
    "linear + window attention": dict(mixer="linear", global_every=2, sliding_window=8),
    "ssd + global attention": dict(mixer="ssd", global_every=2),
}


def _model(kind, seed=0, **extra):
    model = make_model(make_config(**{**BASE, **KINDS[kind], **extra}), seed=seed).eval()
    with torch.no_grad():                     # non-trivial conv taps, decays and skips
        gen = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith(("conv.weight", "dt_bias", "d_skip")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


# --- naive references, one sequence at a time, in float64 -----------------------------------------


def _conv(u, weight):
    """Causal depthwise conv: y_t = sum_i w[:, i] u_{t - width + 1 + i} (zeros before the first token)."""
    width = weight.shape[1]
    return torch.stack([sum(weight[:, i] * u[t - width + 1 + i] for i in range(width) if t - width + 1 + i >= 0)
                        for t in range(u.shape[0])])


def _phi(x):
    """BASED's feature map by enumeration: [1, x, x_i x_j / sqrt(2) for every (i, j)], x scaled by d^-1/4."""
    x = x / x.shape[0] ** 0.25
    return torch.tensor([1.0] + x.tolist() + [x[i] * x[j] / math.sqrt(2) for i in range(len(x)) for j in range(len(x))],
                        dtype=torch.float64)


def naive_linear_attention(layer, x):
    """x (T, D) -> (T, D): a state S (F x H) and normaliser z per head, updated token by token."""
    w = {n: p.detach().double() for n, p in layer.named_parameters()}
    N, d, H = layer.num_heads, layer.feature_dim, layer.head_dim
    u = _conv(torch.cat([x @ w["q_proj.weight"].T, x @ w["k_proj.weight"].T, x @ w["v_proj.weight"].T], -1),
              w["conv.weight"])
    q, k, v = u[:, :N * d], u[:, N * d:2 * N * d], u[:, 2 * N * d:]
    out = torch.zeros(x.shape[0], N * H, dtype=torch.float64)
    for h in range(N):
        S, z = torch.zeros(1 + d + d * d, H, dtype=torch.float64), torch.zeros(1 + d + d * d, dtype=torch.float64)
        for t in range(x.shape[0]):
            pk, pq = _phi(k[t, h * d:(h + 1) * d]), _phi(q[t, h * d:(h + 1) * d])
            S, z = S + torch.outer(pk, v[t, h * H:(h + 1) * H]), z + pk
            out[t, h * H:(h + 1) * H] = (pq @ S) / (pq @ z)
    return out @ w["output_proj.weight"].T


def naive_ssd(layer, x):
    """x (T, D) -> (T, D): Mamba-2's recurrence S_t = exp(-exp(A) dt) S_{t-1} + dt x_t B_t^T, y_t = S_t C_t + D x_t,
    gated by SiLU(z), RMS-normalised, projected."""
    w = {n: p.detach().double() for n, p in layer.named_parameters()}
    N, n, H = layer.num_heads, layer.state_dim, layer.head_dim
    u = F.silu(_conv(torch.cat([x @ w["x_proj.weight"].T, x @ w["b_proj.weight"].T, x @ w["c_proj.weight"].T], -1),
                     w["conv.weight"]))
    xs, b, c = u[:, :N * H], u[:, N * H:N * H + n], u[:, N * H + n:]
    dt = F.softplus(x @ w["dt_proj.weight"].T + w["dt_bias"])
    y = torch.zeros(x.shape[0], N * H, dtype=torch.float64)
    for h in range(N):
        S = torch.zeros(H, n, dtype=torch.float64)
        for t in range(x.shape[0]):
            a = torch.exp(-torch.exp(w["a_log"][h]) * dt[t, h])
            xh = xs[t, h * H:(h + 1) * H]
            S = a * S + dt[t, h] * torch.outer(xh, b[t])
            y[t, h * H:(h + 1) * H] = S @ c[t] + w["d_skip"][h] * xh
    y = y * F.silu(x @ w["gate_proj.weight"].T)
    y = y / torch.sqrt((y * y).mean(-1, keepdim=True) + layer.norm.eps) * w["norm.weight"]
    return y @ w["output_proj.weight"].T


@pytest.mark.parametrize("kind, reference", [("linear", naive_linear_attention), ("ssd", naive_ssd)])
def test_each_layer_equals_its_naive_recurrence(kind, reference):
    layer = _model(kind).layers[0].attn
    x = torch.randn(2, 11, BASE["d_model"], generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out, _ = layer(x)
    for b in range(2):
        expected = reference(layer, x[b].double())
        assert (out[b].double() - expected).abs().max() < 1e-5, f"{kind}: parallel form vs naive recurrence"


def test_taylor_feature_map_inner_products_are_the_second_order_expansion_of_exp():
    q, k = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    s = (q * k).sum(-1) / math.sqrt(6)
    got = (run_taylor_feature_map(q) * run_taylor_feature_map(k)).sum(-1)
    assert torch.allclose(got, 1 + s + s * s / 2)
    assert torch.allclose(run_taylor_feature_map(q)[0], _phi(q[0]))


def test_gated_linear_attention_from_a_state_equals_running_the_tokens_one_by_one():
    """The parallel form from a non-zero state S_0 (decays included) equals a naive loop, in float64."""
    gen = torch.Generator().manual_seed(0)
    B, N, T, Fk, Hv = 2, 3, 9, 5, 4
    q, k = torch.randn(B, N, T, Fk, generator=gen).double(), torch.randn(B, N, T, Fk, generator=gen).double()
    v = torch.randn(B, N, T, Hv, generator=gen).double()
    log_decay = -torch.rand(B, N, T, generator=gen).double()
    state = torch.randn(B, N, Fk, Hv, generator=gen).double()
    got = run_gated_linear_attention(q, k, v, log_decay, state)
    S, expected = state.clone(), torch.zeros(B, N, T, Hv, dtype=torch.float64)
    for t in range(T):
        S = log_decay[:, :, t, None, None].exp() * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        expected[:, :, t] = (q[:, :, t, :, None] * S).sum(-2)
    assert (got - expected).abs().max() < 1e-10


@pytest.mark.parametrize("kind", list(KINDS))
def test_cached_decode_equals_the_full_forward(kind):
    """The recurrent form (one token at a time) and uneven prefill chunks equal the parallel full forward."""
    model = _model(kind)
    ids = torch.randint(0, BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = run_model(model, ids)
        cache = make_kv_cache(model, 2)
        steps = [run_model(model, ids[:, :6], cache=cache)] + [run_model(model, ids[:, t:t + 1], cache=cache)
                                                                for t in range(6, 24)]
        chunked_cache = make_kv_cache(model, 2)
        chunks = [run_model(model, ids[:, a:b], cache=chunked_cache) for a, b in ((0, 5), (5, 13), (13, 24))]
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5
    assert (torch.cat(chunks, 1) - full).abs().max() < 1e-5
    assert cache.length == 24 and chunked_cache.length == 24


def test_a_one_token_prompt_read_from_the_state_equals_the_full_forward():
    """A one-token step reads the state it just updated (the recurrent form): y = phi(q)^T S / phi(q)^T z, where
    phi(q)^T z = 1 + s + s^2 / 2 can be as small as 1/2 (s = -1) after one token, so nothing may clamp it at 1.
    The full forward (the parallel form, checked against the naive recurrence above) is the reference."""
    model = _model("linear", seed=3)
    layer, N, d = model.layers[0].attn, model.layers[0].attn.num_heads, model.layers[0].attn.feature_dim
    ids = torch.arange(BASE["vocab_size"])[:, None]                   # every token as a one-token prompt
    with torch.no_grad():
        h = model.layers[0].ln1(model.token_embeddings(ids))[:, 0].double()
        w = {n: p.detach().double() for n, p in layer.named_parameters()}
        # one token: the causal conv sees zeros before it, so only its last tap acts
        q = h @ w["q_proj.weight"].T * w["conv.weight"][:N * d, -1]
        k = h @ w["k_proj.weight"].T * w["conv.weight"][N * d:2 * N * d, -1]
        den = [float(_phi(q[b, i * d:(i + 1) * d]) @ _phi(k[b, i * d:(i + 1) * d]))
               for b in range(ids.shape[0]) for i in range(N)]
        assert min(den) < 0.9, "the test needs a head whose one-token denominator is below 1"
        full = run_model(model, ids)
        one = run_model(model, ids, cache=make_kv_cache(model, ids.shape[0]))
    assert (one - full).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["linear", "ssd"])
def test_state_bytes_do_not_grow_with_the_context_and_match_the_accounting(kind):
    model = _model(kind)
    cache = make_kv_cache(model, 3)
    before = cache.nbytes
    with torch.no_grad():
        run_model(model, torch.randint(0, 50, (3, 40)), cache=cache)
        for _ in range(10):
            run_model(model, torch.randint(0, 50, (3, 1)), cache=cache)
    assert cache.nbytes == before == run_state_bytes(model.config, 3)
    assert cache.bytes_per_token == 0
    H, N, L = model.config.head_dim, model.config.num_heads, model.config.num_layers
    d, n, width = model.config.feature_dim, model.config.state_dim, model.config.conv_width
    state = N * (1 + d + d * d) * (H + 1) if kind == "linear" else N * n * H      # per layer, per sequence
    conv = (width - 1) * (2 * N * d + N * H if kind == "linear" else N * H + 2 * n)
    assert before == 3 * L * 4 * (state + conv)


def test_a_hybrid_pays_kv_bytes_per_token_for_its_attention_layers_only():
    from cs336_inference.accounting.formulas import kv_cache_bytes_per_token

    model = _model("ssd + global attention")
    cache = make_kv_cache(model, 1)
    assert cache.bytes_per_token == kv_cache_bytes_per_token(model.config, 4) == 2 * 4 * 8 * 4   # 1 layer, K=N=4, H=8
    assert kv_cache_bytes_per_token(_model("ssd").config, 4) == 0


@pytest.mark.parametrize("kind", ["linear", "ssd + global attention"])
def test_left_padding_never_enters_the_state(kind):
    """A left-padded ragged batch, prefilled and decoded, gives each sequence what it gets alone."""
    model = _model(kind)
    gen = torch.Generator().manual_seed(2)
    short, long = torch.randint(1, 50, (7,), generator=gen), torch.randint(1, 50, (12,), generator=gen)
    nxt = torch.randint(1, 50, (2, 3), generator=gen)
    batch = torch.stack([torch.cat([torch.full((5,), 999 % 50), short]), long])
    pad = torch.tensor([5, 0])
    with torch.no_grad():
        cache = make_kv_cache(model, 2)
        out = [run_model(model, batch, cache=cache, pad=pad)[:, -1]]
        out += [run_model(model, nxt[:, t:t + 1], cache=cache, pad=pad)[:, -1] for t in range(3)]
        no_cache = run_model(model, torch.cat([batch, nxt], 1), pad=pad)
        for b, seq in enumerate((short, long)):
            alone = run_model(model, torch.cat([seq, nxt[b]])[None])[0]
            got = torch.stack([o[b] for o in out])
            assert (got - alone[-4:]).abs().max() < 1e-5
            assert (no_cache[b, -4:] - alone[-4:]).abs().max() < 1e-5


def test_an_exception_mid_forward_leaves_the_state_as_it_was():
    model = _model("ssd + global attention")
    cache = make_kv_cache(model, 1)
    ids = torch.randint(0, 50, (1, 10))
    with torch.no_grad():
        run_model(model, ids[:, :6], cache=cache)
        saved = [(c.state.clone(), c.conv.clone()) for c in cache.layers if hasattr(c, "state")]

        def boom(*args):
            raise RuntimeError("boom")
        handle = model.layers[1].ffn.register_forward_hook(boom)
        with pytest.raises(RuntimeError, match="boom"):
            run_model(model, ids[:, 6:8], cache=cache)
        handle.remove()
        assert cache.length == 6
        for (state, conv), c in zip(saved, [c for c in cache.layers if hasattr(c, "state")]):
            assert torch.equal(state, c.state) and torch.equal(conv, c.conv)
        resumed = run_model(model, ids[:, 6:], cache=cache)
        assert (resumed - run_model(model, ids)[:, 6:]).abs().max() < 1e-5


def test_a_state_refuses_a_partial_rollback_and_resets_to_zero():
    model = _model("linear")
    cache = make_kv_cache(model, 1)
    ids = torch.randint(0, 50, (1, 8))
    with torch.no_grad():
        run_model(model, ids, cache=cache)
        for n in (5, 7, 1):              # 7: the one-token rollback speculative decoding would ask for
            with pytest.raises(ValueError, match=f"cannot roll a fixed-state cache back to {n} of its 8 tokens"):
                cache.truncate(n)
        assert cache.length == 8
        cache.truncate(8)
        cache.truncate(0)
        assert cache.length == 0 and all(not c.state.any() for c in cache.layers)
        assert (run_model(model, ids, cache=cache) - run_model(model, ids)).abs().max() < 1e-5


@pytest.mark.parametrize("changes, message", [
    (dict(mixer="rnn"), "mixer"),
    (dict(mixer="ssd", attention_type="mla", kv_lora_rank=8, rope_head_dim=4), "attention_type"),
    (dict(mixer="linear", kv_share_group=2), "kv_share_group"),
    (dict(mixer="linear", sliding_window=8), "set global_every"),
    (dict(mixer="ssd", global_every=1), "mixer='attention'"),
    (dict(mixer="ssd", state_dim=0), "state_dim"),
])
def test_config_refuses_fixed_state_settings_that_do_not_fit(changes, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make_config(**{**BASE, **changes})


def test_the_paged_engine_refuses_a_fixed_state_model_by_name():
    from cs336_inference.serving import PagedKVCache

    with pytest.raises(ValueError, match="fixed-size state"):
        PagedKVCache(_model("ssd"), num_blocks=8, block_size=4)


def test_the_transformer_accounting_refuses_fixed_state_configs_instead_of_miscounting():
    from cs336_inference.accounting.formulas import num_parameters

    with pytest.raises(ValueError, match="accounting.fixed_state"):
        num_parameters(_model("linear").config)


# --- MQAR ----------------------------------------------------------------------------------------


def test_mqar_batches_query_every_key_once_after_its_pair_with_its_value():
    task = make_mqar_task(num_keys=16, num_values=8, seq_len=40)
    inputs, targets = task.batch(32, 6, torch.Generator().manual_seed(0))
    assert inputs.shape == targets.shape == (32, 40) and task.vocab_size == 25
    for x, y in zip(inputs.tolist(), targets.tolist()):
        pairs = dict(zip(x[0:12:2], x[1:12:2]))
        assert len(pairs) == 6 and all(1 <= k <= 16 and 17 <= v <= 24 for k, v in pairs.items())
        queries = [(t, x[t], y[t]) for t in range(40) if y[t] != -100]
        assert sorted(q for _, q, _ in queries) == sorted(pairs) and all(t >= 12 for t, _, _ in queries)
        assert all(pairs[key] == value for _, key, value in queries)
        assert all(x[t] == 0 for t in range(12, 40) if y[t] == -100)      # filler elsewhere
    with pytest.raises(ValueError, match="num_pairs"):
        task.batch(2, 14)


def test_mqar_recall_is_1_for_a_model_that_looks_pairs_up_and_chance_for_a_blind_one():
    task = make_mqar_task(num_keys=16, num_values=8, seq_len=40)

    class LookUp(torch.nn.Module):
        device = torch.device("cpu")

        def __init__(self, blind=False):
            super().__init__()
            self.blind = blind

        def forward(self, ids):
            logits = torch.zeros(*ids.shape, task.vocab_size)
            for b, row in enumerate(ids.tolist()):
                pairs = {row[t]: row[t + 1] for t in range(0, len(row) - 1, 2) if 1 <= row[t] <= 16 and row[t + 1] > 16}
                for t, token in enumerate(row):
                    logits[b, t, 17 if self.blind else pairs.get(token, 0)] = 1.0
            return logits

    assert run_mqar_recall(LookUp(), task, 6) == 1.0
    assert 0.05 < run_mqar_recall(LookUp(blind=True), task, 6) < 0.25      # 1 of 8 values


def test_the_shipped_mqar_models_load_and_have_no_text_tokenizer():
    from cs336_inference.model import load_pretrained, load_tokenizer

    model = load_pretrained("mqar-hybrid")
    assert [type(b.attn).__name__ for b in model.layers] == ["StateSpaceLayer", "GroupedQueryAttention"]
    with pytest.raises(ValueError, match="no tokenizer"):
        load_tokenizer("mqar-ssd")
