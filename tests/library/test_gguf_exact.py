"""`weights="gguf-exact"`: a GGUF model run on its own published Q4_1 / Q8_0 blocks.

References, written here: gguf's own dequantization (`gguf.quants.dequantize`) for what the stored
blocks mean, and a float64 product against it for what the packed kernels compute. The kernels keep
their scale and zero in bf16 (the activation dtype), so each effective weight may differ from gguf's
by the rounding of those two numbers (relative 2^-8 each) plus the bf16 rounding of the output.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from test_gguf_loading import SIZES, Q, write_tiny_gguf

from cs336_inference.model.gguf import gguf_blocks
from cs336_inference.model.real_models import load_gguf_tensors, load_gguf_weights
from cs336_inference.quantization import exact_linear, gguf_exact_model, packed_matmul

EPS = 2.0 ** -8   # bf16's unit roundoff: 8 significant bits, so rounding moves a value by at most 2^-8 of it


def _blocks(shape, qtype, seed=0):
    w = (np.random.default_rng(seed).standard_normal(shape) * 0.1 + 0.02).astype(np.float32)
    raw = quantize(w, qtype)
    return raw, torch.from_numpy(np.array(dequantize(raw, qtype), dtype=np.float32))


@pytest.mark.parametrize("qtype,layout", [(Q.Q4_1, "int4pack"), (Q.Q8_0, "int8 as two int4 planes")])
def test_stored_blocks_become_a_layer_equal_to_ggufs_dequantization(qtype, layout):
    raw, expected = _blocks((48, 96), qtype)
    layer = exact_linear(gguf_blocks(raw, qtype.name))
    assert torch.equal(layer.dequantized_weight(torch.float32), expected)     # bit for bit
    packed = layer.packed_weight()
    assert packed is not None and packed.layout == layout
    # The kernel's effective weight: its output for the unit rows e_k is column k of W^T.
    eye = torch.eye(96, dtype=torch.bfloat16)
    effective = packed_matmul(eye, packed).double().T                          # (O, I)
    blocks = gguf_blocks(raw, qtype.name)
    s = blocks.scale.double().repeat_interleave(32, 1)
    m = blocks.minimum.double().repeat_interleave(32, 1) if blocks.minimum is not None else 0 * s
    u = blocks.codes.double() + (0 if blocks.minimum is not None else 128)    # unsigned codes
    half = 8 if qtype == Q.Q4_1 else 128
    bound = EPS * ((u - half).abs() * s + (m + half * s).abs()) + EPS * effective.abs() + 1e-7
    if qtype == Q.Q8_0:   # two planes: 16 s h + (l s + 8 s), each with its own rounded scale and zero
        bound = bound + EPS * (16 * s * 8 + 8 * s)
    err = (effective - expected.double()).abs()
    assert (err <= bound).all(), f"worst error {float((err - bound).max()):.3g} beyond the bf16 rounding bound"


def test_the_tiny_gguf_runs_exactly_on_its_blocks(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    config, stored = load_gguf_tensors(tmp_path / "tiny.gguf")
    ref_config, state = load_gguf_weights(tmp_path / "tiny.gguf")
    assert config == ref_config
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # every layer has a packed kernel: nothing to announce
        model = gguf_exact_model(config, stored, dtype=torch.float32)
    assert model.lm_head is model.token_embeddings.table                # the tied table is stored once
    for i in range(SIZES["L"]):
        qkv = model.layers[i].attn.qkv_proj.proj.dequantized_weight(torch.float32)
        fused = torch.cat([state[f"layers.{i}.attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(qkv, fused)
        assert torch.equal(model.layers[i].ffn.w2.dequantized_weight(torch.float32), state[f"layers.{i}.ffn.w2.weight"])
        assert torch.equal(model.layers[i].ln1.weight, state[f"layers.{i}.ln1.weight"])
    assert torch.equal(model.token_embeddings(torch.tensor([3, 7])), state["token_embeddings.weight"][[3, 7]])
    # A full forward of many rows takes the dense path: exactly the dequantized reference's numbers.
    from cs336_inference.model.checkpoints import from_state_dict

    reference = from_state_dict(ref_config, state)
    ids = torch.arange(30)[None] % SIZES["V"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids), rtol=1e-5, atol=1e-5)
        # Decode rows go through the packed kernels (bf16 activations): close, not equal.
        cache = model.new_cache(1, 8)
        steps = torch.cat([model(ids[:, t:t + 1], cache=cache) for t in range(8)], dim=1)
    full = reference(ids[:, :8])
    assert (steps - full).abs().max() <= 0.05 * full.abs().max()
    assert "int4pack" in model.describe() and "lm_head: int8pack" in model.describe()   # D = 32: one group a row


def test_weights_option_is_checked():
    from adapters import run_load_pretrained

    with pytest.raises(ValueError, match="unknown weights"):
        run_load_pretrained("smollm2-135m", weights="gguf")
    with pytest.raises(ValueError, match="real models"):
        run_load_pretrained("target", weights="gguf-exact")
    with pytest.raises(TypeError, match="weights"):
        run_load_pretrained("target", weights=1)
