"""Our decode-attention kernel (`workshop.kernels.cpu_attention`, attention kernel "cpu"): against a float64 softmax
written here, routed only where it applies, inside the model against torch's fused attention, and
compiled. Skipped where the CPU cannot run it.

Not graded: this checks the library's own kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import adapters
from decode_checks import OpCalls, assert_compiled_decode_matches_eager
from cs336_inference.workshop.kernels import cpu_attention

why_not = cpu_attention.build()   # builds it here once, where the CPU can run it
needs_kernel = pytest.mark.skipif(why_not is not None, reason=f"our CPU kernels cannot run here: {why_not}")


def reference(q, k, v, scale):
    """softmax(q k^T * scale) v in float64, every key visible."""
    return torch.softmax(q.double() @ k.double().transpose(-1, -2) * scale, dim=-1) @ v.double()


@needs_kernel
@pytest.mark.parametrize("B,K,R,H,S,Hv", [(1, 3, 3, 64, 1, 64), (2, 3, 3, 64, 150, 64), (1, 2, 5, 32, 17, 32),
                                          (3, 1, 1, 128, 1000, 128), (1, 3, 16, 64, 33, 64), (2, 2, 4, 64, 40, 48)])
def test_decode_attention_equals_a_float64_softmax(B, K, R, H, S, Hv):
    g = torch.Generator().manual_seed(S)
    q = torch.randn(B, K, R, H, generator=g).bfloat16()
    # the cache's buffers are longer than what is filled: k and v are strided views, read in place
    k = (2 * torch.randn(B, K, S + 7, H, generator=g)).bfloat16()[:, :, :S]
    v = torch.randn(B, K, S + 7, Hv, generator=g).bfloat16()[:, :, :S]
    out = torch.ops.cs336.decode_attention(q, k, v, H ** -0.5)
    assert out.shape == (B, K, R, Hv) and out.dtype == torch.bfloat16
    # the output is rounded once to bf16 (half an ulp: 2^-9 relative); the rest is fp32 arithmetic
    torch.testing.assert_close(out.double(), reference(q, k, v, H ** -0.5), rtol=2 ** -8, atol=1e-3)


@needs_kernel
@pytest.mark.parametrize("B,K,R,H,S,Hv", [(1, 3, 3, 64, 1, 64), (2, 3, 3, 64, 150, 64), (1, 2, 5, 32, 17, 32),
                                          (3, 1, 1, 128, 1000, 128), (1, 3, 16, 64, 33, 64), (2, 2, 4, 64, 40, 48)])
def test_fp32_decode_attention_equals_a_float64_softmax(B, K, R, H, S, Hv):
    g = torch.Generator().manual_seed(S)
    q = torch.randn(B, K, R, H, generator=g)
    k = (2 * torch.randn(B, K, S + 7, H, generator=g))[:, :, :S]      # strided views of a longer cache
    v = torch.randn(B, K, S + 7, Hv, generator=g)[:, :, :S]
    out = torch.ops.cs336.decode_attention(q, k, v, H ** -0.5)
    assert out.shape == (B, K, R, Hv) and out.dtype == torch.float32
    # fp32 products and sums, no rounding to bf16 anywhere: rounding q, k or v to bf16 (2^-9 relative)
    # would miss this by far
    torch.testing.assert_close(out.double(), reference(q, k, v, H ** -0.5), rtol=1e-5, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_rows_attention_does_not_depend_on_the_batch(dtype):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, 3, 3, 64, generator=g).to(dtype)
    k, v = (torch.randn(4, 3, 300, 64, generator=g).to(dtype) for _ in range(2))
    batched = torch.ops.cs336.decode_attention(q, k, v, 0.125)
    for b in range(4):   # bit for bit, alone or beside three others (several threads may split the batch)
        assert torch.equal(torch.ops.cs336.decode_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], 0.125)[0],
                           batched[b])


@needs_kernel
def test_only_unmasked_bf16_and_fp32_steps_run_our_kernel():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 64, generator=g).bfloat16() for _ in range(3))
    q32, k32, v32 = q.float(), k.float(), v.float()
    mask = torch.tensor([[[[True, True, False]] * 3]])                      # (1, 1, 3, 3): a key hidden
    for args, ours in (((q, k, v, None), True), ((q, k, v, mask), False),
                       ((q32, k32, v32, None), True), ((q32, k32, v32, mask), False),
                       ((q.half(), k.half(), v.half(), None), False),
                       ((q[..., :48], k[..., :48], v, None), False)):
        with OpCalls() as calls:
            out = cpu_attention.attention(*args, scale=None)
        assert ("cs336.decode_attention" in calls.names) == ours, (args[0].dtype, args[3] is None, args[0].shape)
        if not ours:   # torch's fused kernel, unchanged
            sdpa = F.scaled_dot_product_attention(*args[:3], attn_mask=args[3])
            assert torch.equal(out, sdpa)


def _bf16_model(dtype=torch.bfloat16):
    # head dim 32 (our kernel needs H % 32 == 0), two query heads per key/value head: 2 rows per head
    config = adapters.make_config(vocab_size=97, context_length=64, d_model=128, num_layers=2, num_heads=4,
                                  num_kv_heads=2, d_ff=192)
    return adapters.make_model(config, seed=0).eval().to(dtype)


@needs_kernel
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 0.05), (torch.float32, 1e-4)])
def test_a_model_on_the_cpu_kernel_decodes_like_torchs_attention(dtype, atol):
    """Prefill (masked: torch's kernel) then decode steps (ours) give the logits torch's fused attention
    gives, to the dtype's rounding, and the same greedy tokens; the decode steps really ran our kernel."""
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    logits, calls = {}, {}
    for kernel in ("sdpa", "cpu"):
        model = adapters.run_set_attention_kernel(_bf16_model(dtype), kernel)
        cache = adapters.make_kv_cache(model, 2, 24)
        with torch.no_grad(), OpCalls() as recorder:
            steps = [adapters.run_model(model, ids[:, :8], cache)]
            steps += [adapters.run_model(model, ids[:, t:t + 1], cache) for t in range(8, 24)]
        logits[kernel], calls[kernel] = torch.cat(steps, 1).float(), recorder.names.count("cs336.decode_attention")
    assert calls == {"sdpa": 0, "cpu": 2 * 16}                          # 2 layers x 16 decode steps
    torch.testing.assert_close(logits["cpu"], logits["sdpa"], rtol=0, atol=atol)
    prompt = [[1, 2, 3, 4], [5, 6, 7]]
    tokens = {k: adapters.run_generate(adapters.run_set_attention_kernel(_bf16_model(dtype), k), prompt, 12).tokens
              for k in ("sdpa", "cpu")}
    assert tokens["cpu"] == tokens["sdpa"]


@needs_kernel
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 0.05), (torch.float32, 1e-4)])
def test_a_compiled_decode_step_on_the_cpu_kernel_matches_eager(dtype, atol):
    from cs336_inference.generation import compile_decode

    torch._dynamo.reset()
    model = adapters.run_set_attention_kernel(_bf16_model(dtype), "cpu")
    step = compile_decode(model)                                         # fullgraph=True: no graph break
    ids = torch.randint(0, 97, (2, 14), generator=torch.Generator().manual_seed(2))
    assert_compiled_decode_matches_eager(model, step, ids, prefill=8, atol=atol)


def test_the_cpu_kernel_is_refused_where_it_cannot_build(monkeypatch):
    monkeypatch.setattr(cpu_attention, "build", lambda: "the CPU has no AVX512-BF16 (needs e.g. Zen 4)")
    model = _bf16_model()
    before = [block.attn.attention_kernel for block in model.layers]
    with pytest.raises(ValueError, match="attention kernel 'cpu' cannot run here: the CPU has no AVX512-BF16"):
        model.set_attention_kernel("cpu")
    assert [block.attn.attention_kernel for block in model.layers] == before   # unchanged
