"""GGUF -> TransformerLM on a tiny llama file written here with `gguf`'s own writer, the on-disk
cache of converted weights, and tied embeddings through save/load. Fast: no real model needed."""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import pytest
import torch
from adapters import (make_config, make_model, run_load_checkpoint, run_load_cs336_checkpoint, run_load_gguf_weights,
                      run_save_checkpoint)
from gguf.quants import quantize

Q = gguf.GGMLQuantizationType
SIZES = dict(V=40, D=32, L=2, N=4, K=2, F=64)


def write_tiny_gguf(path, seed=0, tied=True):
    """A 2-layer llama GGUF with Q4_1 projections, a Q8_0 embedding and f32 norms; returns the
    float32 tensors it was made from (before quantization)."""
    V, D, L, N, K, F = SIZES.values()
    H = D // N
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, L), (w.add_context_length, 64), (w.add_embedding_length, D),
                       (w.add_feed_forward_length, F), (w.add_head_count, N), (w.add_head_count_kv, K)):
        add(value)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-5)
    made = {}

    def tensor(name, shape, qtype=Q.Q4_1):
        x = (rng.standard_normal(shape) * 0.2 + (1.0 if qtype == Q.F32 else 0.0)).astype(np.float32)
        made[name] = x
        w.add_tensor(name, x) if qtype == Q.F32 else w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)

    tensor("token_embd.weight", (V, D), Q.Q8_0)
    tensor("output_norm.weight", (D,), Q.F32)
    if not tied:
        tensor("output.weight", (V, D), Q.Q8_0)
    for i in range(L):
        for name, shape in (("attn_norm", (D,)), ("ffn_norm", (D,))):
            tensor(f"blk.{i}.{name}.weight", shape, Q.F32)
        for name, shape in (("attn_q", (N * H, D)), ("attn_k", (K * H, D)), ("attn_v", (K * H, D)),
                            ("attn_output", (D, N * H)), ("ffn_gate", (F, D)), ("ffn_up", (F, D)),
                            ("ffn_down", (D, F))):
            tensor(f"blk.{i}.{name}.weight", shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return made


def test_tiny_gguf_maps_onto_the_cs336_layout(tmp_path):
    made = write_tiny_gguf(tmp_path / "tiny.gguf")
    config, state = run_load_gguf_weights(tmp_path / "tiny.gguf")
    V, D, L, N, K, F = SIZES.values()
    assert (config.vocab_size, config.d_model, config.num_layers, config.num_heads, config.num_kv_heads,
            config.d_ff, config.rope_theta, config.tie_embeddings) == (V, D, L, N, K, F, 50000.0, True)
    assert "lm_head.weight" not in state
    # 4-bit blocks of 32 with a scale and a minimum: within half a step of the original values
    for gguf_name, key in (("blk.1.ffn_down.weight", "layers.1.ffn.w2.weight"),
                           ("blk.0.attn_k.weight", "layers.0.attn.k_proj.weight"),
                           ("token_embd.weight", "token_embeddings.weight"), ("output_norm.weight", "ln_final.weight")):
        x = torch.from_numpy(made[gguf_name])
        blocks = x.reshape(-1, 32) if x.numel() % 32 == 0 and x.dim() > 1 else x.reshape(1, -1)
        half_step = (blocks.amax(1) - blocks.amin(1)) / 15 / 2 + 1e-3
        err = (state[key] - x).reshape(blocks.shape).abs().amax(1)
        assert (err <= half_step).all(), f"{key}: error {err.max():.4f} exceeds half a quantization step"
    model = run_load_cs336_checkpoint(state, config)
    assert model.lm_head.weight is model.token_embeddings.weight
    assert torch.isfinite(model(torch.arange(10))).all()


def test_untied_gguf_keeps_its_output_matrix(tmp_path):
    made = write_tiny_gguf(tmp_path / "untied.gguf", tied=False)
    config, state = run_load_gguf_weights(tmp_path / "untied.gguf")
    assert config.tie_embeddings is False and state["lm_head.weight"].shape == made["output.weight"].shape


def test_conversion_is_cached_on_disk_and_rebuilt_when_damaged(tmp_path, monkeypatch):
    from cs336_inference.model import real_models

    monkeypatch.setenv("CS336_CACHE_DIR", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "tiny.gguf")
    config, state = run_load_gguf_weights(tmp_path / "tiny.gguf", cache_as="tiny")
    entry = next((tmp_path / "cache").glob("tiny-*"))
    assert (entry / "weights-float32.pt").is_file() and (entry / "config.json").is_file()

    def no_conversion(path):
        raise AssertionError("the cached weights should have been used")

    monkeypatch.setattr(real_models, "read_gguf", no_conversion)
    config2, state2 = run_load_gguf_weights(tmp_path / "tiny.gguf", cache_as="tiny")
    assert config2 == config and all(torch.equal(state[k], state2[k]) for k in state)
    _, bf16 = run_load_gguf_weights(tmp_path / "tiny.gguf", torch.bfloat16, cache_as="tiny")  # cast from fp32
    assert bf16["ln_final.weight"].dtype == torch.bfloat16 and (entry / "weights-bfloat16.pt").is_file()



def _flip_bytes(path, count=585):
    data = bytearray(path.read_bytes())
    for i in range(count):                      # inside the tensor data, the file keeps its size
        data[len(data) // 2 + 7 * i] ^= 0x5A
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flipped bytes", "truncated", "empty", "edited config", "no checksum"])
def test_a_damaged_or_edited_cache_file_is_named_and_rebuilt(tmp_path, monkeypatch, damage):
    """Every cached file is checked against the checksum written with it: silent corruption (bytes flipped
    inside the weights, a hand-edited rope_theta) must never load; the warning names the file."""
    monkeypatch.setenv("CS336_CACHE_DIR", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "tiny.gguf")
    config, state = run_load_gguf_weights(tmp_path / "tiny.gguf", cache_as="tiny")
    entry = next((tmp_path / "cache").glob("tiny-*"))
    target = entry / ("config.json" if damage == "edited config" else "weights-float32.pt")
    if damage == "flipped bytes":
        _flip_bytes(target)
    elif damage == "truncated":
        target.write_bytes(target.read_bytes()[:1000])
    elif damage == "empty":
        target.write_bytes(b"")
    elif damage == "edited config":
        target.write_text(target.read_text().replace('"rope_theta": 50000.0', '"rope_theta": 10000.0'))
        assert "10000.0" in target.read_text()
    else:
        (entry / "weights-float32.pt.crc32").unlink()
    with pytest.warns(UserWarning, match=f"damaged cache file {target}"):
        config2, rebuilt = run_load_gguf_weights(tmp_path / "tiny.gguf", cache_as="tiny")
    assert config2 == config and config2.rope_theta == 50000.0
    assert all(torch.equal(state[k], rebuilt[k]) for k in state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # rebuilt with a fresh checksum: the next load is quiet
        run_load_gguf_weights(tmp_path / "tiny.gguf", cache_as="tiny")


def test_tied_model_saves_one_table_and_refuses_a_different_head(tmp_path):
    config = make_config(vocab_size=40, context_length=32, d_model=16, num_layers=1, num_heads=2, d_ff=32,
                         tie_embeddings=True)
    model = make_model(config)
    assert model.lm_head.weight is model.token_embeddings.weight
    assert model.num_parameters() == make_model(config.replace(tie_embeddings=False)).num_parameters() - 40 * 16
    run_save_checkpoint(tmp_path / "tied.pt", model)
    loaded = run_load_checkpoint(tmp_path / "tied.pt")
    assert loaded.lm_head.weight is loaded.token_embeddings.weight
    torch.testing.assert_close(loaded(torch.arange(8)), model(torch.arange(8)))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] += 1
    with pytest.raises(ValueError, match="tie_embeddings"):
        run_load_cs336_checkpoint(state, config)
    with pytest.raises(TypeError, match="tie_embeddings"):
        make_config(tie_embeddings=1)


def test_gguf_round_trip_is_idempotent_and_within_half_a_step():
    from adapters import run_gguf_round_trip

    w = torch.randn(8, 96) * 0.3
    once = run_gguf_round_trip(w, "Q4_1")
    assert torch.equal(run_gguf_round_trip(once, "Q4_1"), once)       # already on the grid: bit for bit
    blocks = w.reshape(-1, 32)
    half = ((blocks.amax(1) - blocks.amin(1)) / 15 / 2)[:, None] * 1.01 + 1e-3   # fp16 scale/min rounding
    assert ((once - w).reshape(-1, 32).abs() <= half).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        run_gguf_round_trip(torch.randn(4, 40))
    with pytest.raises(ValueError, match="unknown GGUF"):
        run_gguf_round_trip(w, "Q9_9")
