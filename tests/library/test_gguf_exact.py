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
from smollm2_reference import requires_smollm2
from test_gguf_loading import SIZES, Q, write_tiny_gguf

from adapters import (make_exact_linear, make_rescored_head, run_gguf_exact_model, run_load_gguf_tensors,
                      run_load_gguf_weights, run_packed_matmul)

from cs336_inference.model.gguf import gguf_blocks

EPS = 2.0 ** -8   # bf16's unit roundoff: 8 significant bits, so rounding moves a value by at most 2^-8 of it


def _blocks(shape, qtype, seed=0):
    w = (np.random.default_rng(seed).standard_normal(shape) * 0.1 + 0.02).astype(np.float32)
    raw = quantize(w, qtype)
    return raw, torch.from_numpy(np.array(dequantize(raw, qtype), dtype=np.float32))


@pytest.mark.parametrize("qtype,layout", [(Q.Q4_1, "int4pack"), (Q.Q8_0, "int8 as two int4 planes")])
def test_stored_blocks_become_a_layer_equal_to_ggufs_dequantization(qtype, layout):
    raw, expected = _blocks((48, 96), qtype)
    layer = make_exact_linear(raw, qtype.name)
    assert torch.equal(layer.dequantized_weight(torch.float32), expected)     # bit for bit
    packed = layer.packed_weight()
    assert packed is not None and packed.layout == layout
    # The kernel's effective weight: its output for the unit rows e_k is column k of W^T.
    eye = torch.eye(96, dtype=torch.bfloat16)
    effective = run_packed_matmul(eye, layer).double().T                       # (O, I)
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


def test_the_rescored_head_ranks_with_the_stored_weights_not_with_bf16_rounding():
    """The packed head's bf16 logits (about 30 here, 0.125 apart) swap close candidates; RescoredHead
    recomputes the kernel's top k in fp32 from the codes: those k equal x W_hat^T computed here in
    float64 from gguf's dequantization, the others are the kernel's, and every argmax is the exact one."""
    raw, expected = _blocks((64, 96), Q.Q8_0, seed=1)
    layer = make_exact_linear(raw, "Q8_0")
    head = make_rescored_head(layer, k=4)
    x = (torch.randn(2000, 96, generator=torch.Generator().manual_seed(0)) * 30).to(torch.bfloat16)
    with torch.no_grad():
        fast, out = layer(x).float(), head(x)
    exact = x.double() @ expected.double().T                                   # (2000, 64)
    top = fast.topk(4, dim=-1).indices
    torch.testing.assert_close(out.gather(-1, top).double(), exact.gather(-1, top), rtol=1e-6, atol=1e-4)
    rest = torch.ones_like(out, dtype=torch.bool).scatter(-1, top, False)
    assert out.dtype == torch.float32 and torch.equal(out[rest], fast[rest])
    assert int((fast.argmax(-1) != exact.argmax(-1)).sum()) > 0              # bf16 alone gets some wrong
    assert torch.equal(out.argmax(-1), exact.argmax(-1))
    assert "top 4 logits rescored in fp32" in head.kernel_summary()
    with pytest.raises(ValueError, match="k must be"):
        make_rescored_head(layer, k=0)


def test_the_tiny_gguf_runs_exactly_on_its_blocks(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf")
    config, stored = run_load_gguf_tensors(tmp_path / "tiny.gguf")
    ref_config, state = run_load_gguf_weights(tmp_path / "tiny.gguf")
    assert config == ref_config
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # every layer has a packed kernel: nothing to announce
        model = run_gguf_exact_model(config, stored, dtype=torch.float32)
    assert model.lm_head.head is model.token_embeddings.table           # the tied table is stored once
    for i in range(SIZES["L"]):
        qkv = model.layers[i].attn.qkv_proj.proj.dequantized_weight(torch.float32)
        fused = torch.cat([state[f"layers.{i}.attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(qkv, fused)
        assert torch.equal(model.layers[i].ffn.w2.dequantized_weight(torch.float32), state[f"layers.{i}.ffn.w2.weight"])
        assert torch.equal(model.layers[i].ln1.weight, state[f"layers.{i}.ln1.weight"])
    assert torch.equal(model.token_embeddings(torch.tensor([3, 7])), state["token_embeddings.weight"][[3, 7]])
    # On torch's kernel, a full forward of many rows takes the dense path: exactly the dequantized reference's
    # numbers. Our kernel takes fp32 activations at every row count (two bf16 halves): close to them.
    from cs336_inference.model.checkpoints import from_state_dict
    from cs336_inference.workshop.kernels import cpu_int4

    reference = from_state_dict(ref_config, state)
    with cpu_int4.torch_kernel_only():
        on_torchs = run_gguf_exact_model(config, stored, dtype=torch.float32)
    bar = max(m.dense_above() for m in on_torchs.modules() if hasattr(m, "dense_above"))   # the kernels' own bars
    ids = torch.arange(30 * (bar // 30 + 1)).view(-1, 30) % SIZES["V"]    # more rows than that
    with torch.no_grad():
        want = reference(ids)
        torch.testing.assert_close(on_torchs(ids), want, rtol=1e-5, atol=1e-5)
        # ours (where it runs): its grid keeps scale and zero in bf16, hence the decode steps' bound below
        torch.testing.assert_close(model(ids), want, rtol=0, atol=0.05 * float(want.abs().max()))
        ids = ids[:1]
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


@pytest.mark.slow
@requires_smollm2
def test_smollm2_exact_int4_is_within_001_nats_of_the_fp32_reference_on_real_text():
    """The goal of the exact path: the published blocks, decoded through the packed kernels (bf16
    activations), stay within 0.01 nats/token of the dequantized fp32 model on the real-text split."""
    from adapters import run_load_pretrained

    from cs336_inference.data.real_text import pydoc_documents, token_stream
    from cs336_inference.model import load_tokenizer

    reference, exact = run_load_pretrained("smollm2-135m"), run_load_pretrained("smollm2-135m", weights="gguf-exact")
    w = exact.layers[3].ffn.w2.dequantized_weight(torch.float32)
    assert torch.equal(w, reference.layers[3].ffn.w2.weight)          # the same weights, bit for bit
    tok = load_tokenizer("smollm2-135m")
    ids = token_stream(tok, pydoc_documents("eval"), tok.special_to_id.get("<|endoftext|>"))[:128][None]
    with torch.inference_mode():
        ref = reference(ids).float().log_softmax(-1)
        cache = exact.new_cache(1, ids.shape[1])
        out = torch.cat([exact(ids[:, t:t + 1], cache=cache) for t in range(ids.shape[1])], 1).float().log_softmax(-1)
    kl = float((ref.exp() * (ref - out)).sum(-1).mean())
    assert kl <= 0.01, f"KL(fp32 || exact int4) = {kl:.4f} nats/token"
    assert int((ref.argmax(-1) == out.argmax(-1)).sum()) >= 124     # same-context next token, of 128


def _edited_copy(tmp_path, name, qtype=None, edit=None):
    """tiny.gguf with tensor `name`'s type field set to `qtype` and/or its stored data edited in place by
    `edit(array)` (the file's own bytes, memory-mapped read-write): what a damaged or hand-edited file holds."""
    import gguf

    path = tmp_path / "edited.gguf"
    write_tiny_gguf(path)
    reader = gguf.GGUFReader(path, "r+")
    tensor = next(t for t in reader.tensors if t.name == name)
    if qtype is not None:
        tensor.field.parts[4][0] = int(qtype)     # the tensor-info record: name, n_dims, dims, type, offset
    if edit is not None:
        edit(tensor.data)
    reader.data.flush()
    del reader
    return path


def _both_paths_refuse(path, *words):
    for load in (run_load_gguf_tensors, run_load_gguf_weights):   # gguf-exact's tensors, the dequantized path
        with pytest.raises(ValueError) as info:
            load(path)
        for word in (path.name, *words):
            assert word in str(info.value), f"{load.__name__}: {word!r} not in {info.value}"


def test_an_inf_in_a_float_norm_weight_is_refused_on_both_paths_naming_tensor_and_file(tmp_path):
    """An inf norm weight made the exact path's logits all NaN without an error."""
    def put_inf(data):
        data[3] = np.inf

    path = _edited_copy(tmp_path, "blk.0.attn_norm.weight", edit=put_inf)
    _both_paths_refuse(path, "blk.0.attn_norm.weight", "NaN/Inf")
    write_tiny_gguf(tmp_path / "clean.gguf")
    config, stored = run_load_gguf_tensors(tmp_path / "clean.gguf")
    stored["data"]["blk.1.ffn_norm.weight"][0] = float("nan")    # handed over directly, without a file
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_norm\.weight"):
        run_gguf_exact_model(config, stored, dtype=torch.float32)


def test_an_inf_block_scale_is_refused_on_both_paths_naming_tensor_and_file(tmp_path):
    def inf_scale(data):                       # block 0 of row 5: its fp16 scale d, little-endian 0x7C00 = +inf
        data[5, 0], data[5, 1] = 0x00, 0x7C

    path = _edited_copy(tmp_path, "blk.1.ffn_down.weight", edit=inf_scale)
    _both_paths_refuse(path, "blk.1.ffn_down.weight", "NaN/Inf")


def test_a_changed_type_field_is_refused_naming_tensor_and_file(tmp_path):
    """Q4_1 blocks (20 bytes) read as Q8_0 (34 bytes): some bytes that were codes become a NaN/Inf scale.
    It used to be refused as "qt.scale contains NaN/Inf", which named neither the tensor nor the file."""
    path = _edited_copy(tmp_path, "blk.0.attn_q.weight", qtype=Q.Q8_0)
    _both_paths_refuse(path, "blk.0.attn_q.weight", "NaN/Inf")


def _compiler_imported(code: str) -> bool:
    """Run `code` in a fresh interpreter (this one's import path and environment); whether `torch._dynamo`,
    torch's compiler, was imported by then (and, as a check of the probe, not already by `import torch`)."""
    import os
    import subprocess
    import sys

    probe = ("import sys, torch\nassert 'torch._dynamo' not in sys.modules, 'imported by torch itself'\n"
             f"{code}\nprint('compiler imported:', 'torch._dynamo' in sys.modules)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1] == "compiler imported: True"


def test_building_the_exact_model_does_not_import_torchs_compiler(tmp_path):
    """The plain load never compiles, so it must not pay for importing torch's compiler (a meta tensor's random
    init or copy would import it); a `normal_` on a meta tensor, run the same way, does (the probe can fail)."""
    write_tiny_gguf(tmp_path / "tiny.gguf")
    load = (f"from cs336_inference.model.real_models import load_gguf_tensors\n"
            f"from cs336_inference.quantization import gguf_exact_model\n"
            f"config, stored = load_gguf_tensors({str(tmp_path / 'tiny.gguf')!r})\n"
            f"model = gguf_exact_model(config, stored, dtype=torch.float32)\n"
            f"model(torch.tensor([[1, 2, 3]]))")
    assert not _compiler_imported(load)
    assert _compiler_imported("torch.empty(4, device='meta').normal_()")


@requires_smollm2
@pytest.mark.slow
def test_loading_smollm2_exact_does_not_import_torchs_compiler():
    load = ("from cs336_inference import load_pretrained\n"
            "load_pretrained('smollm2-135m', weights='gguf-exact')")
    assert not _compiler_imported(load)


@requires_smollm2
@pytest.mark.slow
def test_smollm2_from_the_packed_cache_equals_a_plain_load_and_a_damaged_cache_file_is_rebuilt(tmp_path, monkeypatch):
    """The fast path's packed-layout cache (kernel layouts and packed codes, `startup.cached_packed_weights`):
    a load that fills it, one that takes everything from it and one after a byte of the file was flipped
    (warned about, rebuilt) all give the logits of a load without any cache, to the bit."""
    from adapters import run_load_pretrained

    from cs336_inference.model import disk_cache
    from cs336_inference.workshop.startup import cached_packed_weights

    monkeypatch.setattr(disk_cache, "cache_entry", lambda name, source: tmp_path)   # not the user's cache
    ids = torch.tensor([[504, 3458, 282, 4649, 314, 7042, 30]])

    def logits(model):
        with torch.inference_mode():
            return model(ids)

    reference = logits(run_load_pretrained("smollm2-135m", dtype=torch.float32, weights="gguf-exact"))

    def cached():
        with cached_packed_weights("smollm2-135m", torch.device("cpu"), torch.float32) as store:
            model = run_load_pretrained("smollm2-135m", dtype=torch.float32, weights="gguf-exact")
        return logits(model), store

    first, store = cached()
    assert store.reused == 0 and any("tensor" in e for e in store.made)   # packed codes are kept too
    again, store = cached()
    assert store.reused == len(store.made) and torch.equal(again, reference) and torch.equal(first, reference)
    (path,) = tmp_path.glob("packed-*.pt")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="damaged cache file"):
        rebuilt, store = cached()
    assert store.reused == 0 and torch.equal(rebuilt, reference)


def test_skipping_init_touches_only_models_built_on_the_meta_device():
    """`uninitialized()` (the exact loader's skeleton): a model built on the CPU inside it is initialized
    exactly as outside (same seed, same weights); one built on the meta device gets every parameter, each
    shaped as a normal build's, and fusing its projections works there too."""
    from cs336_inference.model import ModelConfig, TransformerLM
    from cs336_inference.model.transformer import uninitialized

    config = ModelConfig.from_name("tiny")
    torch.manual_seed(0)
    outside = TransformerLM(config)
    with uninitialized():
        torch.manual_seed(0)
        inside = TransformerLM(config)
        skeleton = TransformerLM(config, device="meta").fuse_projections()
    assert all(torch.equal(a, b) for a, b in zip(outside.state_dict().values(), inside.state_dict().values()))
    expected = {k: v.shape for k, v in outside.state_dict().items()}
    assert {k: v.shape for k, v in skeleton.state_dict().items()} == expected
    assert all(t.is_meta for t in skeleton.state_dict().values())
    assert skeleton.rope.cos.is_meta and skeleton.rope.cos.shape == outside.rope.cos.shape
