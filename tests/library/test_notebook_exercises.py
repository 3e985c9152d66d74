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


# --- 03 quantization ------------------------------------------------------------------------------

def test_03_exercise_1_one_outlier_ruins_a_per_tensor_scale_not_per_channel_ones():
    from cs336_inference.model import load_pretrained
    from cs336_inference.quantization import quantize_tensor

    w = load_pretrained("target").layers[0].ffn.w1.weight.detach().clone()
    spiked = w.clone()
    spiked[0, 0] = 100.0

    def mse_of_other_rows(x, granularity):
        return float((quantize_tensor(x, 8, True, granularity).dequantize() - x)[1:].pow(2).mean())

    assert mse_of_other_rows(spiked, "channel") == mse_of_other_rows(w, "channel")   # row 0 has its own scale
    assert mse_of_other_rows(spiked, "tensor") > 100 * mse_of_other_rows(w, "tensor")
    # by hand: one absmax scale over the tensor is 100 / 127; every other weight is below half a step, so it
    # rounds to 0 and the error is the weights themselves
    assert w[1:].abs().max() < 100 / 127 / 2
    assert torch.all(quantize_tensor(spiked, 8, True, "tensor").dequantize()[1:] == 0)
    assert mse_of_other_rows(spiked, "tensor") == pytest.approx(float(w[1:].pow(2).mean()))


def test_03_exercise_2_int4_packing_round_trips_and_halves_the_bytes():
    from cs336_inference.quantization import pack_int4, unpack_int4

    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 2)     # every code, (3, 32)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 16) and packed.nbytes * 2 == codes.nbytes
    assert torch.equal(unpack_int4(packed), codes)


def test_03_exercise_3_gptq_gain_holds_on_text_it_was_not_calibrated_on():
    from cs336_inference.data import load_corpus
    from cs336_inference.model import load_pretrained
    from cs336_inference.quantization import capture_linear_inputs, gptq_quantize, layer_output_error, quantize_tensor

    model = load_pretrained("target")
    name = "layers.0.ffn.w2"

    def inputs(split):
        data = load_corpus(split)
        starts = torch.linspace(0, data.numel() - 129, 4).long().tolist()
        return capture_linear_inputs(model, [name], [torch.stack([data[s:s + 128] for s in starts])])[0][name]

    calibration, held_out = inputs("train"), inputs("val")
    w = model.get_submodule(name).weight.detach()
    rtn = quantize_tensor(w, 3, False, "channel").dequantize()
    gptq = gptq_quantize(w, inputs=calibration, bits=3).quantized.dequantize()
    assert layer_output_error(w, gptq, held_out) < 0.7 * layer_output_error(w, rtn, held_out)


# --- 04 pruning and distillation ------------------------------------------------------------------

@pytest.fixture(scope="module")
def nb04():
    from cs336_inference.compression import importance_scores
    from cs336_inference.data import load_corpus
    from cs336_inference.model import load_pretrained

    target = load_pretrained("target")
    calibration = load_corpus("train")[: 4 * 257].view(4, 257)
    return target, calibration, importance_scores(target, calibration), load_corpus("val")


def _bpb(model, val):
    from cs336_inference.data import evaluate_lm

    return evaluate_lm(model, val, seq_len=256, batch_size=4, max_batches=2)["bits_per_byte"]


def test_04_exercise_1_importance_beats_random_channels(nb04):
    from cs336_inference.compression import prune_model

    target, calibration, scores, val = nb04
    F = target.config.d_ff
    by_importance = prune_model(target, calibration, d_ff=F // 2, scores=scores)
    random_scores = dict(scores, mlp=torch.rand(scores["mlp"].shape, generator=torch.Generator().manual_seed(0)))
    at_random = prune_model(target, calibration, d_ff=F // 2, scores=random_scores)
    assert _bpb(target, val) < _bpb(by_importance, val) < _bpb(at_random, val) - 0.1


def test_04_exercise_2_parameter_count_of_the_pruned_model(nb04):
    from cs336_inference.compression import prune_model

    target, calibration, scores, _ = nb04
    pruned = prune_model(target, calibration, num_layers=3, num_kv_heads=1, d_ff=320, scores=scores)
    c = pruned.config
    V, D, F, N, K, H, L = c.vocab_size, c.d_model, c.d_ff, c.num_heads, c.num_kv_heads, c.head_dim, c.num_layers
    assert (L, K, F) == (3, 1, 320)
    assert pruned.num_parameters() == 2 * V * D + L * (3 * D * F + 2 * D * N * H + 2 * D * K * H + 2 * D) + D


def test_04_exercise_3_drop_the_least_important_layer(nb04):
    from cs336_inference.compression import prune_model

    target, calibration, scores, val = nb04
    least = prune_model(target, calibration, num_layers=target.config.num_layers - 1, scores=scores)
    most = prune_model(target, calibration, num_layers=target.config.num_layers - 1,
                       scores=dict(scores, layers=-scores["layers"]))
    assert _bpb(least, val) < _bpb(most, val) - 1.0


# --- 06 continuous batching -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def nb06():
    from cs336_inference.data import load_corpus
    from cs336_inference.model import load_pretrained
    from cs336_inference.serving import Engine, TraceConfig, make_trace

    model = load_pretrained("target").eval()
    config = TraceConfig(num_requests=6, rate=60.0, prompt_len=(16, 40), max_new_tokens=16, stop_tokens=(10,),
                         sampled_fraction=0.0, seed=0)
    requests = make_trace(load_corpus("val")[1000:], config)
    return {(policy, seqs): Engine(model, scheduler=policy, max_num_seqs=seqs).run(requests)
            for policy in ("static", "continuous") for seqs in (1, 4)}


def test_06_exercise_1_padding_rows_of_static_batching(nb06):
    for policy in ("static", "continuous"):
        result = nb06[(policy, 4)]
        useful = sum(s.num_prefills + s.num_decodes - s.num_padding for s in result.steps)
        assert useful == sum(len(t) for o in result.outputs for t in o.tokens)
    assert sum(s.num_padding for s in nb06[("static", 4)].steps) > 0
    assert sum(s.num_padding for s in nb06[("continuous", 4)].steps) == 0


def test_06_exercise_2_one_sequence_at_a_time_leaves_nothing_to_schedule(nb06):
    assert len(nb06[("static", 1)].steps) == len(nb06[("continuous", 1)].steps)
    assert len(nb06[("continuous", 4)].steps) < len(nb06[("static", 4)].steps)


def test_06_exercise_3_ttft_p99_by_hand(nb06):
    import numpy as np

    result = nb06[("continuous", 4)]
    ttft = [min(t[0] for t in o.token_times if t) - o.arrival_time for o in result.outputs]
    assert result.summary()["ttft_p99_s"] == pytest.approx(np.percentile(ttft, 99))
    # p99 of 6 values with linear interpolation: between the two largest, 95% of the way
    top = sorted(ttft)
    assert np.percentile(ttft, 99) == pytest.approx(top[-2] + 0.95 * (top[-1] - top[-2]))


# --- 07 paged attention ---------------------------------------------------------------------------

def test_07_exercise_1_internal_fragmentation_by_hand():
    from cs336_inference.serving import KVCacheManager

    lengths, bs = [37, 5, 60], 16
    m = KVCacheManager(num_blocks=32, block_size=bs, prefix_caching=False)
    for i, n in enumerate(lengths):
        m.allocate(i, list(range(1000 * i, 1000 * i + n)))
    s = m.memory_stats()
    reserved = sum(-(-n // bs) * bs for n in lengths)          # ceil(n / bs) blocks each
    assert (s.reserved_tokens, s.used_tokens) == (reserved, sum(lengths)) == (128, 102)
    assert s.internal_fragmentation_tokens == reserved - sum(lengths)   # only the last blocks are partly empty


def test_07_exercise_2_copy_on_write_after_two_forks():
    from cs336_inference.serving import KVCacheManager

    m = KVCacheManager(num_blocks=16, block_size=4, prefix_caching=False)
    m.allocate("a", list(range(10)))                 # blocks of 4 + 4 + 2
    m.fork("a", "b")
    m.fork("a", "c")
    copies = [m.allocate_slots(seq) for seq in ("b", "c", "a")]
    # the last block is shared three ways: the first two writers copy it, the last one owns it by then
    assert [len(c) for c in copies] == [1, 1, 0]
    assert len({blk for seq in "abc" for blk in m.table(seq).blocks}) == 3 + 2
    assert m.memory_stats().used_tokens == 8 + 3 * 3      # two shared full blocks, three private tails of 3


def test_07_exercise_3_three_requests_behind_one_system_prompt():
    from cs336_inference.serving import KVCacheManager

    m = KVCacheManager(num_blocks=32, block_size=16)
    system = list(range(100, 164))                    # 64 tokens: 4 full blocks
    cached = []
    for i in range(3):
        cached.append(m.allocate(i, system + [i, i + 1, i + 2]))
        m.cache_blocks(i, system + [i, i + 1, i + 2])
    assert cached == [0, 64, 64]
    assert len({blk for i in range(3) for blk in m.table(i).blocks}) == 4 + 3   # shared prefix + one tail each


# --- 05 speculative sampling ----------------------------------------------------------------------

def test_05_exercise_1_half_accepted_and_the_residual_on_one_token():
    from fractions import Fraction as Fr

    from cs336_inference.generation import speculative_output_distribution

    q = (Fr(1, 2), Fr(1, 2), Fr(0))          # the target wants tokens 0 and 1
    p = (Fr(0), Fr(1, 2), Fr(1, 2))          # the draft never proposes 0 and wastes half its mass on 2
    d = speculative_output_distribution(p, q)
    assert sum(d.accepted) == sum(min(a, b) for a, b in zip(p, q)) == Fr(1, 2)   # alpha
    assert d.residual == (1, 0, 0) and d.output == q                              # exact all the same


@pytest.mark.parametrize("v", [1, 1.5])
def test_05_exercise_2_when_one_draft_token_is_best(v):
    from cs336_inference.generation import optimal_gamma

    alpha = 0.8
    # gamma = 1 beats gamma = 2 iff (1 + a) / (c + v) >= (1 + a + a^2) / (2c + v)  <=>  c >= a^2 v / (1 + a - a^2)
    threshold = alpha**2 * v / (1 + alpha - alpha**2)
    for c in (0.5 * threshold, 0.9 * threshold):
        assert optimal_gamma(alpha, c, verify_cost=v) > 1
    for c in (1.1 * threshold, 2 * threshold, 10 * threshold):
        assert optimal_gamma(alpha, c, verify_cost=v) == 1
