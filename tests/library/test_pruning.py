"""Pruning keeps the requested structure (checked against references computed here) and distillation
moves the student towards the teacher."""

import pytest
import torch
import torch.nn.functional as F
from adapters import (make_config, make_model, make_train_config, run_compare_to_reference, run_distill,
                      run_generate, run_importance_scores, run_load_corpus, run_model, run_prune_model)
from reference_model import ref_attention, ref_rmsnorm, ref_rope


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


CFG = dict(vocab_size=257, context_length=64, d_model=32, num_layers=3, num_heads=4, num_kv_heads=2, d_ff=48)


def _calibration(n=4, t=33, seed=0):
    return run_load_corpus("train")[seed * 10_000:seed * 10_000 + n * t].view(n, t)


def _model(seed=0):
    return make_model(make_config(**CFG), seed=seed)


def test_mlp_pruning_equals_zeroing_the_least_active_channels():
    model, calib = _model(), _calibration()
    pruned = run_prune_model(model, calib, d_ff=20)
    assert pruned.config.d_ff == 20 and pruned.config.d_model == 32 and pruned.config.num_layers == 3
    # Reference: mean |SwiGLU hidden activation| per channel, by running the blocks by hand.
    reference = make_model(make_config(**CFG))
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        x = model.token_embeddings(calib[:, :-1])
        T = x.shape[1]
        rope = model.rope.angles(torch.arange(T))
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))[None, None]
        for i, block in enumerate(model.layers):
            h = x + block.attn(block.ln1(x), rope, mask)[0]
            z = block.ln2(h)
            hidden = F.silu(z @ block.ffn.w1.weight.T) * (z @ block.ffn.w3.weight.T)  # (B, T, F)
            keep = hidden.abs().mean(dim=(0, 1)).argsort(descending=True)[:20]
            drop = torch.ones(48, dtype=torch.bool)
            drop[keep] = False
            reference.layers[i].ffn.w2.weight[:, drop] = 0.0
            x = h + block.ffn(z)
        ids = torch.randint(0, 257, (2, 40))
        torch.testing.assert_close(run_model(pruned, ids), run_model(reference, ids), rtol=1e-5, atol=1e-5)


def test_layer_pruning_drops_the_layer_whose_removal_hurts_least():
    model, calib = _model(), _calibration()
    pruned = run_prune_model(model, calib, num_layers=2)
    x, y = calib[:, :-1], calib[:, 1:]

    def loss_without(skip):
        with torch.no_grad():
            h = model.token_embeddings(x)
            T = x.shape[1]
            rope = model.rope.angles(torch.arange(T))
            mask = torch.tril(torch.ones(T, T, dtype=torch.bool))[None, None]
            for i, block in enumerate(model.layers):
                if i != skip:
                    h, _ = block(h, rope, mask)
            return F.cross_entropy(model.lm_head(model.ln_final(h)).flatten(0, 1), y.flatten()).item()

    dropped = min(range(3), key=loss_without)
    kept = [i for i in range(3) if i != dropped]
    for new_i, i in enumerate(kept):
        for name, tensor in model.layers[i].state_dict().items():
            assert torch.equal(pruned.layers[new_i].state_dict()[name], tensor), f"layer {i} {name}"


def test_gqa_head_pruning_keeps_whole_groups():
    model, calib = _model(), _calibration()
    pruned = run_prune_model(model, calib, num_kv_heads=1)  # keeps G = 2 -> N = 2, D = 2 * H = 16
    cfg = pruned.config
    assert (cfg.num_kv_heads, cfg.num_heads, cfg.d_model, cfg.head_dim) == (1, 2, 16, 8)
    dims = torch.tensor(pruned.pruned_from["d_model_channels"])
    assert len(dims) == 16 and len(set(dims.tolist())) == 16
    for i in range(3):
        src, dst = model.layers[i].attn, pruned.layers[i].attn
        k_src = src.k_proj.weight[:, dims]  # (K H, D')
        matches = [g for g in range(2) if torch.equal(dst.k_proj.weight, k_src[g * 8:(g + 1) * 8])]
        assert len(matches) == 1, f"layer {i}: kept k_proj rows are not one whole KV group"
        g = matches[0]
        # the query heads kept are exactly the two heads of that group (group g = heads 2g, 2g+1)
        torch.testing.assert_close(dst.q_proj.weight, src.q_proj.weight[g * 16:(g + 1) * 16][:, dims])
        torch.testing.assert_close(dst.v_proj.weight, src.v_proj.weight[g * 8:(g + 1) * 8][:, dims])
    assert pruned.num_parameters() < model.num_parameters()


def test_pruned_model_cached_generation_equals_full_forward():
    model = _model()
    pruned = run_prune_model(model, _calibration(), prune_ratio=0.5)
    cfg = pruned.config
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.d_ff) == (2, 1, 24)
    prompt = torch.randint(0, 257, (2, 7))
    cached = run_generate(pruned, prompt, 12)
    naive = run_generate(pruned, prompt, 12, use_cache=False)
    assert cached.tokens == naive.tokens
    # and the cached logits equal the full forward at every position
    full = torch.cat([prompt, torch.tensor(cached.tokens)], dim=1)
    with torch.no_grad():
        ref = run_model(pruned, full)
        cache = pruned.new_cache(2)
        step = [run_model(pruned, full[:, :7], cache=cache)]
        for t in range(7, full.shape[1]):
            step.append(run_model(pruned, full[:, t:t + 1], cache=cache))
    torch.testing.assert_close(torch.cat(step, dim=1), ref, rtol=1e-4, atol=1e-4)


def test_importance_scores_equal_activations_measured_by_hand():
    """heads: mean L2 norm of each head's attention output; mlp: mean |SwiGLU hidden|; embedding: mean |x| at
    every RMSNorm input, summed; layers: loss increase when the layer is skipped. Measured here with the
    naive reference (per-head loops, ref_rope), never with the library's hooks."""
    model, calib = _model(), _calibration()
    s = run_importance_scores(model, calib)
    assert s["heads"].shape == (3, 4) and s["kv_groups"].shape == (3, 2) and s["mlp"].shape == (3, 48)
    assert s["layers"].shape == (3,) and s["embedding"].shape == (32,)
    state, x_ids = model.state_dict(), calib[:, :-1]
    B, T = x_ids.shape
    N, K, H, eps = 4, 2, 8, model.config.norm_eps
    pos, causal = torch.arange(T), torch.tril(torch.ones(T, T, dtype=torch.bool))
    heads, mlp, embedding = torch.zeros(3, N), torch.zeros(3, 48), torch.zeros(32)
    x = state["token_embeddings.weight"][x_ids]
    with torch.no_grad():
        for i in range(3):
            p = f"layers.{i}."
            embedding += x.abs().sum((0, 1))
            h = ref_rmsnorm(x, state[p + "ln1.weight"], eps)
            q, k, v = (h @ state[p + f"attn.{n}_proj.weight"].T for n in "qkv")
            out = torch.zeros(B, T, N * H)
            for b in range(B):
                for n in range(N):
                    j = n // (N // K)
                    o = ref_attention(ref_rope(q[b, :, n * H:(n + 1) * H], pos, model.config.rope_theta),
                                      ref_rope(k[b, :, j * H:(j + 1) * H], pos, model.config.rope_theta),
                                      v[b, :, j * H:(j + 1) * H], causal)
                    out[b, :, n * H:(n + 1) * H] = o
                    heads[i, n] += o.norm(dim=-1).sum()
            x = x + out @ state[p + "attn.output_proj.weight"].T
            embedding += x.abs().sum((0, 1))
            z = ref_rmsnorm(x, state[p + "ln2.weight"], eps)
            hidden = F.silu(z @ state[p + "ffn.w1.weight"].T) * (z @ state[p + "ffn.w3.weight"].T)
            mlp[i] = hidden.abs().sum((0, 1))
            x = x + hidden @ state[p + "ffn.w2.weight"].T
        embedding += x.abs().sum((0, 1))
    tokens = B * T
    torch.testing.assert_close(s["heads"], heads / tokens, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s["kv_groups"], (heads / tokens).view(3, 2, 2).sum(-1), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s["mlp"], mlp / tokens, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(s["embedding"], embedding / tokens, rtol=1e-4, atol=1e-5)
    base = F.cross_entropy(model(x_ids).flatten(0, 1), calib[:, 1:].flatten()).item()
    assert s["calibration_loss"] == pytest.approx(base, rel=1e-5)
    assert bool((s["layers"].abs() > 1e-4).all()), "skipping a layer of a random model changes the loss"


def test_distillation_reduces_kl_on_held_out_data():
    teacher = _model(seed=1)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(4.0)  # a peaked, confident teacher: something to learn
    student = run_prune_model(teacher, _calibration(), num_layers=2, d_ff=24)
    held_out = run_load_corpus("val")[:4000]
    before = run_compare_to_reference(student, teacher, held_out, seq_len=32, max_batches=4)["kl"]
    cfg = make_train_config(steps=40, batch_size=8, seq_len=32, lr=5e-3, warmup_steps=4, eval_every=40,
                            eval_batches=1, progress=False)
    run_distill(student, teacher, cfg, train_data=run_load_corpus("train")[:100_000], val_data=held_out)
    after = run_compare_to_reference(student, teacher, held_out, seq_len=32, max_batches=4)["kl"]
    assert after < 0.7 * before, f"KL to the teacher went from {before:.4f} to {after:.4f}"


def test_bad_pruning_inputs_and_model_untouched():
    model = _model()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for ratio in (0, 1, 1.5, -0.2):
        with pytest.raises(ValueError, match="prune_ratio"):
            run_prune_model(model, _calibration(), prune_ratio=ratio)
    for empty in (torch.empty(0, dtype=torch.long), []):
        with pytest.raises(ValueError, match="calibration set is empty"):
            run_prune_model(model, empty, num_layers=2)
    with pytest.raises(ValueError, match="num_layers"):
        run_prune_model(model, _calibration(), num_layers=5)
    with pytest.raises(ValueError, match="d_model"):
        run_prune_model(model, _calibration(), d_model=20)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), f"a failed prune changed {name}"
