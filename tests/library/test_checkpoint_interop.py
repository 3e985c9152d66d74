"""Loading students' own assignment-1 layouts (not graded): key maps for renamed keys, a fused q/k/v and a
fused gate/up projection, and the errors for what cannot load. The state dicts are built here the way the
students' repositories lay them out (we cannot download them): renamed, fused by concatenation, a 2024
architecture, blocks missing. A loaded model must compute exactly what the original computes."""

import pytest
import torch
from adapters import make_config, make_model, run_load_cs336_checkpoint, run_model

from cs336_inference.model import COMMON_RENAMES, rename_keys, split_fused_gate_up, split_fused_qkv

CFG = dict(vocab_size=257, context_length=32, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48)


@pytest.fixture(scope="module")
def original():
    return make_model(make_config(**CFG), seed=3)


def _same_model(loaded, original):
    x = torch.randint(0, 257, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(run_model(loaded, x), run_model(original, x), atol=0, rtol=0)


def _student_names(state):
    """The names one student repository used: token_embedding, attention.out_proj, feed_forward.{gate,up,
    down}_proj, attn_norm/ffn_norm/final_norm with .gain, blocks."""
    out = {}
    for k, v in state.items():
        k = (k.replace("token_embeddings.", "token_embedding.").replace("layers.", "blocks.")
             .replace("attn.output_proj", "attention.out_proj").replace("attn.", "attention.")
             .replace("ffn.w1", "feed_forward.gate_proj").replace("ffn.w3", "feed_forward.up_proj")
             .replace("ffn.w2", "feed_forward.down_proj").replace("ln1.weight", "attn_norm.gain")
             .replace("ln2.weight", "ffn_norm.gain").replace("ln_final.weight", "final_norm.gain"))
        out[k] = v
    return out


def test_renamed_keys_load_with_common_renames_and_the_error_says_so(original):
    state = _student_names(original.state_dict())
    cfg = make_config(**CFG)
    with pytest.raises(ValueError) as err:
        run_load_cs336_checkpoint(state, cfg)
    message = str(err.value)
    assert "blocks.0.attention.out_proj.weight" in message and "missing keys" in message   # every key named
    assert "key_map=COMMON_RENAMES loads this checkpoint" in message
    _same_model(run_load_cs336_checkpoint(state, cfg, key_map=COMMON_RENAMES), original)


def test_a_regex_dict_or_a_key_function_renames_keys(original):
    state = {k.replace("ffn.", "mlp."): v for k, v in original.state_dict().items()}
    cfg = make_config(**CFG)
    _same_model(run_load_cs336_checkpoint(state, cfg, key_map={r"\.mlp\.": ".ffn."}), original)
    _same_model(run_load_cs336_checkpoint(state, cfg, key_map=rename_keys(lambda k: k.replace("mlp.", "ffn."))),
                original)
    extra = {**state, "layers.0.attn.rotary.inv_freq": torch.zeros(4)}   # a buffer to drop: the function returns None
    drop = rename_keys(lambda k: None if "rotary" in k else k.replace("mlp.", "ffn."))
    with pytest.raises(ValueError, match=r"key_map discarded 1 tensor\(s\) \['layers.0.attn.rotary.inv_freq'\].*"
                                         r"allow_dropped=(.|\n)*RoPE tables"):
        run_load_cs336_checkpoint(extra, cfg, key_map=drop)        # dropping is never silent
    with pytest.warns(UserWarning, match=r"discarded 1 tensor\(s\).*layers.0.attn.rotary.inv_freq \(4,\)"):
        _same_model(run_load_cs336_checkpoint(extra, cfg, key_map=drop, allow_dropped="rotary"), original)


def _fuse(state, names, fused):
    """Concatenate the rows of `names` (in order) of each layer into one `fused` weight."""
    out = {}
    for k, v in state.items():
        prefix, _, rest = k.partition(".attn.") if ".attn." in k else k.partition(".ffn.")
        section = "attn." if ".attn." in k else "ffn."
        if any(k.endswith(f"{section}{n}.weight") for n in names):
            layer = k.split(f".{section}")[0]
            out.setdefault(f"{layer}.{section}{fused}.weight", []).append((names.index(rest.split(".")[0]), v))
        else:
            out[k] = v
    return {k: torch.cat([t for _, t in sorted(v, key=lambda p: p[0])]) if isinstance(v, list) else v
            for k, v in out.items()}


def test_fused_qkv_and_fused_gate_up_are_split(original):
    cfg = make_config(**CFG)
    state = _fuse(original.state_dict(), ["q_proj", "k_proj", "v_proj"], "qkv_proj")
    state = _fuse(state, ["w1", "w3"], "gate_up_proj")
    assert "layers.0.attn.qkv_proj.weight" in state and state["layers.0.attn.qkv_proj.weight"].shape == (64, 32)
    with pytest.raises(ValueError) as err:
        run_load_cs336_checkpoint(state, cfg)
    message = str(err.value)
    assert "split_fused_qkv('attn.qkv_proj.weight')" in message
    assert "split_fused_gate_up('ffn.gate_up_proj.weight')" in message
    key_map = [split_fused_qkv("attn.qkv_proj.weight"), split_fused_gate_up("ffn.gate_up_proj.weight")]
    _same_model(run_load_cs336_checkpoint(state, cfg, key_map=key_map), original)
    # another layout: k, v, q order and up before gate, as some repositories store them
    other = _fuse(_fuse(original.state_dict(), ["k_proj", "v_proj", "q_proj"], "wqkv"), ["w3", "w1"], "w13")
    key_map = [split_fused_qkv("attn.wqkv.weight", order="kvq"), split_fused_gate_up("ffn.w13.weight", "up_gate")]
    _same_model(run_load_cs336_checkpoint(other, cfg, key_map=key_map), original)


def test_a_fused_weight_of_the_wrong_size_is_refused_by_name(original):
    state = _fuse(original.state_dict(), ["q_proj", "k_proj", "v_proj"], "qkv_proj")
    mha = make_config(**{**CFG, "num_kv_heads": 4})     # expects 96 rows
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.qkv_proj\.weight has 64 rows; .* 96"):
        run_load_cs336_checkpoint(state, mha, key_map=split_fused_qkv())


def test_a_2024_format_checkpoint_gets_its_own_message(original):
    state = {k: v for k, v in original.state_dict().items() if ".ffn.w3." not in k}
    state["position_embeddings.weight"] = torch.zeros(32, 32)
    with pytest.raises(ValueError, match="2024-format assignment-1 checkpoint: learned absolute position embeddings"):
        run_load_cs336_checkpoint(state, make_config(**CFG))


def test_a_checkpoint_without_layer_weights_gets_its_own_message(original):
    state = {k: v for k, v in original.state_dict().items() if not k.startswith("layers.")}
    with pytest.raises(ValueError) as err:
        run_load_cs336_checkpoint(state, make_config(**CFG))
    assert "holds no layer weights at all" in str(err.value) and "nn.ModuleList" in str(err.value)
    assert "layers.0.attn.q_proj.weight" in str(err.value)     # the missing keys are still listed


def test_key_maps_that_are_not_maps_are_refused(original):
    with pytest.raises(TypeError, match="key_map"):
        run_load_cs336_checkpoint(original.state_dict(), make_config(**CFG), key_map="COMMON_RENAMES")
    with pytest.raises(ValueError, match="maps two keys"):
        run_load_cs336_checkpoint(original.state_dict(), make_config(**CFG), key_map={r"\.w[13]\.": ".w1."})


def test_bad_key_maps_get_clear_errors_not_torch_or_re_internals(original):
    state, cfg = original.state_dict(), make_config(**CFG)
    with pytest.raises(ValueError, match=r"key_map pattern '\(ffn' is not a valid regular expression"):
        run_load_cs336_checkpoint(state, cfg, key_map={"(ffn": "x"})
    with pytest.raises(TypeError, match=r"key_map patterns must be regex strings, got 3 \(int\)"):
        run_load_cs336_checkpoint(state, cfg, key_map={3: "x"})
    with pytest.raises(TypeError, match=r"replacement for '\\\\.ffn\\\\.' must be a str .* got 7 \(int\)"):
        run_load_cs336_checkpoint(state, cfg, key_map={r"\.ffn\.": 7})
    with pytest.raises(ValueError, match=r"replacement '\\\\2' for pattern .* fails on key"):
        run_load_cs336_checkpoint(state, cfg, key_map={r"^(layers)": r"\2"})
    with pytest.raises(TypeError, match="a key_map function must return a str"):
        run_load_cs336_checkpoint(state, cfg, key_map=rename_keys(lambda k: 0))
    with pytest.raises(TypeError, match="a key_map callable must return a dict of str -> tensor"):
        run_load_cs336_checkpoint(state, cfg, key_map=lambda sd, c: {1: torch.zeros(1)})
    with pytest.raises(TypeError, match=r"a state dict maps str keys to tensors; these entries do not: \[0\]"):
        run_load_cs336_checkpoint({**state, 0: torch.zeros(1)}, cfg)


def test_nan_or_inf_weights_are_refused_by_name(original):
    state = dict(original.state_dict())
    state["layers.1.ffn.w2.weight"] = state["layers.1.ffn.w2.weight"].clone()
    state["layers.1.ffn.w2.weight"][0, :3] = float("nan")
    state["ln_final.weight"] = torch.full_like(state["ln_final.weight"], float("inf"))
    with pytest.raises(ValueError, match=r"2 checkpoint tensors hold NaN or inf.*layers\.1\.ffn\.w2\.weight "
                                         r"\(3 NaN, 0 inf of 1536\); ln_final\.weight \(0 NaN, 32 inf of 32\)"):
        run_load_cs336_checkpoint(state, make_config(**CFG))


def test_a_device_that_is_not_there_and_a_name_that_is_not_a_str(original, tmp_path):
    from cs336_inference.model import load, load_pretrained, save
    missing = "cuda" if not torch.cuda.is_available() else f"cuda:{torch.cuda.device_count()}"
    save(tmp_path / "m.pt", original)
    for call in (lambda: load(tmp_path / "m.pt", device=missing), lambda: load_pretrained("draft", device=missing),
                 lambda: run_load_cs336_checkpoint(original.state_dict(), make_config(**CFG), device=missing)):
        with pytest.raises(ValueError, match=rf"device='{missing}' but (no CUDA GPU is available|this machine has)"):
            call()
    with pytest.raises(ValueError, match="device='gpu' is not a device"):
        load(tmp_path / "m.pt", device="gpu")
    with pytest.raises(TypeError, match=r"name must be a model name \(str\).*got list"):
        load_pretrained(["draft"])
