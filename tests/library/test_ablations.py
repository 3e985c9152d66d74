"""The assignment-1 handout's ablations as ModelConfig fields: each against the naive reference written from
the math (tests/reference_model.py), with a KV cache (prefill + decode == full forward), with GQA, through
save/load, and each refusal naming the fix."""

import pytest
import torch
from adapters import make_config, make_kv_cache, make_model, run_model
from reference_model import ref_forward

from cs336_inference.model import PostNormBlock, TransformerBlock, load, save

BASE = dict(vocab_size=97, context_length=32, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48)
VARIANTS = {
    "post_norm": dict(norm_position="post"),
    "nope": dict(positional="none"),
    "silu_ffn": dict(ffn="silu"),
    "no_norm": dict(norm="none"),
    "no_norm_final_only": dict(norm="none", final_norm=True),
    "post_norm_no_final": dict(norm_position="post", final_norm=False),
    "qk_norm_gain": dict(qk_norm="gain", qk_norm_eps=1e-6),
    "qk_norm_no_gain": dict(qk_norm="no_gain"),
    "per_norm_eps": dict(ln1_eps=1e-2, ln2_eps=1e-3, ln_final_eps=0.5),
    "post_nope_silu_qk": dict(norm_position="post", positional="none", ffn="silu", qk_norm="gain"),
    "mha_qk_no_gain_nope": dict(num_kv_heads=4, qk_norm="no_gain", positional="none"),
    "mqa_post": dict(num_kv_heads=1, norm_position="post"),
}


def _model(**changes):
    """A seeded model whose norm gains are random too (so a misplaced or missing norm shows)."""
    model = make_model(make_config(**{**BASE, **changes}), seed=1)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))
    return model


@pytest.mark.parametrize("changes", VARIANTS.values(), ids=VARIANTS)
def test_each_ablation_matches_the_naive_reference_and_the_kv_cache(changes):
    model = _model(**changes)
    x = torch.randint(0, BASE["vocab_size"], (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = run_model(model, x)
        want = ref_forward(model.state_dict(), model.config, x)
        cache = make_kv_cache(model, 2)
        steps = [run_model(model, x[:, :6], cache)] + [run_model(model, x[:, t:t + 1], cache) for t in range(6, 11)]
    torch.testing.assert_close(full, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-5, rtol=0)


def test_ablations_differ_from_the_base_model_on_the_same_weights():
    """Not a no-op: each field changes the logits of the same weights (post-norm, NoPE, weightless QK-norm
    share the base model's state-dict keys; that is why `verify_checkpoint` exists)."""
    base = _model()
    x = torch.randint(0, BASE["vocab_size"], (1, 9), generator=torch.Generator().manual_seed(3))
    for changes in (dict(norm_position="post"), dict(positional="none"), dict(qk_norm="no_gain")):
        other = _model(**changes)
        assert other.state_dict().keys() == base.state_dict().keys()
        other.load_state_dict(base.state_dict())
        with torch.no_grad():
            assert (run_model(other, x) - run_model(base, x)).abs().max() > 1e-2, changes


def test_state_dict_keys_of_each_ablation():
    keys = lambda **c: set(_model(**c).state_dict())  # noqa: E731
    base = keys()
    assert keys(ffn="silu") == {k for k in base if ".ffn.w3." not in k}
    assert keys(norm="none") == {k for k in base if ".ln" not in k and k != "ln_final.weight"}
    assert keys(norm_position="post", final_norm=False) == base - {"ln_final.weight"}
    gains = keys(qk_norm="gain") - base
    assert gains == {f"layers.{i}.attn.{n}_norm.weight" for i in range(2) for n in "qk"}
    assert _model(qk_norm="gain").state_dict()["layers.0.attn.q_norm.weight"].shape == (8,)   # H entries
    assert keys(qk_norm="no_gain") == base
    assert type(_model(norm_position="post").layers[0]) is PostNormBlock
    assert type(_model().layers[0]) is TransformerBlock


def test_base_model_attention_calls_apply_rope_directly():
    """The variants are picked at build time: the base model's token path is unchanged (no wrapper call)."""
    from cs336_inference.model import apply_rope
    attn = _model().layers[0].attn
    assert attn.rotate_q is apply_rope and attn.rotate_k is apply_rope


@pytest.mark.parametrize("changes", [VARIANTS["post_nope_silu_qk"], VARIANTS["no_norm"], VARIANTS["per_norm_eps"]],
                         ids=["post_nope_silu_qk", "no_norm", "per_norm_eps"])
def test_ablations_save_load_and_fuse(tmp_path, changes):
    model = _model(**changes)
    save(tmp_path / "m.pt", model)
    loaded = load(tmp_path / "m.pt")
    assert loaded.config == model.config
    x = torch.randint(0, BASE["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = run_model(model, x)
        torch.testing.assert_close(run_model(loaded, x), want, atol=0, rtol=0)
        torch.testing.assert_close(run_model(loaded.fuse_projections(), x), want, atol=1e-5, rtol=1e-5)


def test_sliding_window_and_cla_take_the_ablations():
    cfg = dict(norm_position="post", positional="none", qk_norm="gain", sliding_window=4, kv_share_group=2)
    model = _model(**cfg)
    x = torch.randint(0, BASE["vocab_size"], (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = run_model(model, x)
        cache = make_kv_cache(model, 1)
        steps = [run_model(model, x[:, :5], cache)] + [run_model(model, x[:, t:t + 1], cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-5, rtol=0)


@pytest.mark.parametrize("changes, message", [
    (dict(norm_position="middle"), r"norm_position must be one of \('pre', 'post'\)"),
    (dict(positional="alibi"), r"positional must be one of \('rope', 'none'\)"),
    (dict(ffn="gelu"), r"ffn must be one of \('swiglu', 'silu'\)"),
    (dict(norm="layernorm"), r"norm must be one of \('rmsnorm', 'none'\)"),
    (dict(qk_norm=True), r"qk_norm must be one of \('none', 'gain', 'no_gain'\)"),
    (dict(final_norm="yes"), "final_norm must be True or False"),
    (dict(ln1_eps=0.0), "ln1_eps"),
    (dict(norm="none", norm_position="post"), "leave norm_position='pre'"),
    (dict(norm="none", ln1_eps=1e-6), r"\['ln1_eps'\] set for norms this config does not build"),
    (dict(qk_norm_eps=1e-6), r"qk_norm_eps'\] set for norms"),
    (dict(attention_type="mla", kv_lora_rank=8, rope_head_dim=4, num_kv_heads=None, positional="none"),
     "use attention_type='gqa' for NoPE or QK-norm"),
])
def test_ablation_fields_are_validated_with_the_fix(changes, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make_config(**{**BASE, **changes})


def test_transforms_that_assume_the_base_block_refuse_an_ablation():
    from cs336_inference.compression import prune_model
    from cs336_inference.quantization import quantize_model
    model = _model(norm_position="post")
    calib = torch.randint(0, BASE["vocab_size"], (2, 16))
    with pytest.raises(ValueError, match=r"base block only .* \{'norm_position': 'post'\}"):
        quantize_model(model, "awq", bits=4, group_size=16, calibration=calib)
    with pytest.raises(ValueError, match="base block only"):
        prune_model(_model(ffn="silu"), calib, d_ff=32)


@pytest.mark.parametrize("eps, other", [(1e-6, 0.5), (0.5, 1e-6)])
def test_qk_norm_uses_its_own_eps_where_the_eps_matters(eps, other):
    """The qk_norm_eps field, inside the square root: with q and k projections scaled down to rows of mean
    square ~1e-3, eps = 1e-6 and eps = 0.5 give logits far apart (checked on the reference), so a model using
    norm_eps, a fixed eps, or eps outside the root fails the comparison with the naive reference."""
    model = _model(qk_norm="gain", qk_norm_eps=eps, norm_eps=1e-5)
    with torch.no_grad():
        for block in model.layers:
            block.attn.q_proj.weight.mul_(0.05)
            block.attn.k_proj.weight.mul_(0.05)
    x = torch.randint(0, BASE["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(4))
    state = model.state_dict()
    want = ref_forward(state, model.config, x)
    elsewhere = ref_forward(state, model.config.replace(qk_norm_eps=other), x)
    assert float((want - elsewhere).abs().max()) > 100 * 2e-5, "eps must matter at this scale for the test to bite"
    with torch.no_grad():
        torch.testing.assert_close(run_model(model, x), want, atol=2e-5, rtol=1e-4)
