"""Answers to the exercises at the end of each notebook (`notebooks/NN_topic.py`), as tests: each
solves the exercise with the library, as a student would, and checks the answer against an
independent computation. Small models, one thread: the whole file runs in a few seconds."""

import pytest
import torch

from cs336_inference import ByteTokenizer, ModelConfig, TransformerLM, generate
from cs336_inference.generation import decode_one_token, prefill

pytestmark = pytest.mark.usefixtures("one_thread")


def _nb00_model():
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=257, context_length=512, d_model=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, d_ff=128)
    return TransformerLM(config).eval()


# --- 00 generation --------------------------------------------------------------------------------

def test_00_exercise_1_own_greedy_loop_reproduces_generate():
    model = _nb00_model()
    prompt = ByteTokenizer().encode("Once upon a time")
    cache = model.new_cache(batch_size=1)
    tokens = []
    with torch.no_grad():
        logits = prefill(model, torch.tensor([prompt]), cache)
        for _ in range(32):
            token = logits.argmax(-1)                 # (B,)
            tokens.append(int(token))
            logits = decode_one_token(model, token, cache)
    assert tokens == generate(model, [prompt], 32).tokens[0]


def test_00_exercise_2_cache_bytes_from_the_formula():
    model = _nb00_model()
    c = model.config
    predicted = 2 * 8 * c.num_kv_heads * 512 * c.head_dim * c.num_layers * 4   # K and V, fp32
    assert model.new_cache(batch_size=8, max_seq_len=512).nbytes == predicted


def test_00_exercise_3_positions_run_through_the_model():
    model = _nb00_model()
    counted = []
    forward = model.forward

    def counting_forward(token_ids, *args, **kwargs):
        counted.append(token_ids.shape[-1])
        return forward(token_ids, *args, **kwargs)

    model.forward = counting_forward
    P, N = 11, 9
    prompt = list(range(1, P + 1))
    for use_cache, expected in ((False, sum(P + t for t in range(N))), (True, P + N - 1)):
        counted.clear()
        generate(model, [prompt], N, use_cache=use_cache)
        assert sum(counted) == expected, (use_cache, counted)


# --- 01 arithmetic intensity ----------------------------------------------------------------------

LLAMA2_13B = dict(V=32000, D=5120, F=13824, N=40, H=128, L=40)   # from the Llama 2 paper, written out here


def _llama2_13b_params(K: int) -> int:
    V, D, F, N, H, L = (LLAMA2_13B[k] for k in "VDFNHL")
    return 2 * V * D + 3 * D * F * L + (2 * D * N * H + 2 * D * K * H) * L


def test_01_exercise_1_smallest_compute_bound_batch():
    from cs336_inference.accounting import HARDWARE
    from cs336_inference.accounting import symbolic as sym

    ridge = HARDWARE["H100"].accelerator_intensity
    intensity = sym.matmul_cost().intensity.subs({sym.D: 4096, sym.F: 4096})
    answer = next(b for b in range(1, 4096) if float(intensity.subs(sym.B, b)) > ridge)
    by_hand = next(b for b in range(1, 4096) if 2 * b * 4096 * 4096 / (2 * (b * 4096 + 4096 * 4096 + b * 4096))
                   > 989e12 / 3.35e12)
    assert answer == by_hand and 295 < answer < 450   # above B = 295: the D, F terms do not vanish at 4096


def test_01_exercise_2_largest_batch_that_fits():
    from cs336_inference.accounting import max_batch_size, with_kv_heads

    for K in (40, 8):
        kv_per_sequence = 1024 * K * 128 * 40 * 2 * 2
        by_hand = int((80e9 - 2 * _llama2_13b_params(K)) // kv_per_sequence)
        assert max_batch_size(with_kv_heads("llama2-13b", K), "H100", seq_len=1024) == by_hand
    assert by_hand > 5 * 64   # K = 8: over five times the K = 40 batch (the cache shrinks 5x)


def test_01_exercise_3_context_where_the_cache_outweighs_the_weights():
    from cs336_inference.accounting import REAL_MODELS, kv_cache_bytes_per_token, num_parameters

    llama = REAL_MODELS["llama2-13b"]
    answer = 2 * num_parameters(llama) / kv_cache_bytes_per_token(llama)
    by_hand = 2 * _llama2_13b_params(40) / (40 * 128 * 40 * 2 * 2)
    assert answer == pytest.approx(by_hand) and 30_000 < answer < 33_000   # far beyond the 4096 context at B = 1


# --- 02 KV cache ----------------------------------------------------------------------------------

NB02_BASE = dict(vocab_size=257, context_length=128, d_model=64, num_layers=4, num_heads=4, d_ff=176)


def test_02_exercise_1_gqa_cache_shrinks_n_over_k():
    mha = TransformerLM(ModelConfig(**NB02_BASE)).new_cache(1, 128).nbytes
    for K in (4, 2, 1):
        gqa = TransformerLM(ModelConfig(**NB02_BASE, num_kv_heads=K)).new_cache(1, 128).nbytes
        assert mha == gqa * (4 // K) == 2 * 4 * 128 * 16 * 4 * 4   # K, V x N heads x S x H x L x fp32


def test_02_exercise_2_mla_against_mha_of_the_same_heads():
    from cs336_inference.accounting import REAL_MODELS, kv_cache_bytes_per_token

    ds = REAL_MODELS["deepseek-v2"]
    mha = ds.replace(name="deepseek-v2-mha", attention_type="gqa", kv_lora_rank=None, rope_head_dim=None)
    ratio = kv_cache_bytes_per_token(mha) / kv_cache_bytes_per_token(ds)
    assert ratio == pytest.approx(2 * 128 * 128 / (512 + 64))   # 2 N H over C + R, per layer (N = 128, H = 128)
    assert ratio > 56


def test_02_exercise_3_receptive_field_of_a_window():
    torch.manual_seed(0)
    L, W = 4, 16
    model = TransformerLM(ModelConfig(**NB02_BASE, sliding_window=W)).eval()
    x = torch.randint(0, 257, (1, 80))
    y = x.clone()
    y[0, 0] = (x[0, 0] + 1) % 257
    with torch.no_grad():
        changed = ((model(x) - model(y)).abs().amax(-1)[0] > 0).nonzero().flatten().tolist()
    assert changed == list(range(L * (W - 1) + 1))   # positions 0 .. 60 see token 0, 61 on do not
