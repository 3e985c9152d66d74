"""CS336 Lecture 10: Inference, executable.

Mirrors the official lecture's sections and order (../shared/LECTURE10.md); unlike the original it
*runs* every technique with `cs336_inference` on a real (tiny) model. Every number stated is computed
by the library and asserted. Run directly to read the narration in a terminal; under edtrace the
same calls produce a trace for the CS336 trace viewer.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from lecture_util import Reference, link, section, text  # noqa: E402

from cs336_inference import ByteTokenizer, ModelConfig, TransformerLM, generate, get_device, seed_everything  # noqa: E402

vllm = Reference(title="Efficient Memory Management for Large Language Model Serving with PagedAttention",
                 authors=["Woosuk Kwon", "Zhuohan Li", "Siyuan Zhuang"], date="2023-09-12",
                 url="https://arxiv.org/abs/2309.06180")
sglang = Reference(title="SGLang: Efficient Execution of Structured Language Model Programs",
                   authors=["Lianmin Zheng", "Liangsheng Yin"], date="2023-12-12",
                   url="https://arxiv.org/abs/2312.07104")


def main():
    # 1. Understanding the inference workload
    landscape()
    review_transformer()
    review_of_arithmetic_intensity()
    arithmetic_intensity_of_inference()
    throughput_and_latency()
    # 2. Taking shortcuts (lossy)
    reduce_kv_cache_size()
    quantization()
    model_pruning()
    # 3. Use shortcuts but double check (lossless)
    speculative_sampling()
    # 4. Handling dynamic workloads
    continuous_batching()
    paged_attention()
    # 5. Summary
    summary()


def landscape():
    section("landscape")
    text("Inference is where a model earns its keep: chat, code completion, agents and batch jobs in "
         "deployment, but also evaluation and the rollouts of reinforcement learning.")
    text("Training is paid once; inference is paid for every token ever served. One provider reported "
         "serving ~8.6T tokens per day, against ~32T tokens to pretrain a frontier model: a few days "
         "of traffic equal a whole pretraining run. Agents can generate without bound.")
    text("Open-source engines: vLLM (PagedAttention), SGLang (RadixAttention), TensorRT-LLM, llama.cpp.")
    link(vllm)
    link(sglang)
    text("Metrics: time to first token (TTFT), latency per token for one request, and throughput "
         "(tokens/s) over many requests.")
    text("Training sees the whole sequence at once and parallelises over it; generation produces one "
         "token at a time, each depending on the last. That sequential loop is what this lecture is about.")


def review_transformer():
    section("review_transformer")
    text("Notation: B batch, S tokens already in the cache, T new tokens, D d_model, F d_ff, N query "
         "heads, K key/value heads, G = N/K, H head dim, L layers, V vocab.")
    device = get_device()
    seed_everything(0)
    config = ModelConfig.from_name("tiny")  # @inspect config
    model = TransformerLM(config).to(device).eval()
    n_params = model.num_parameters()  # @inspect n_params
    text(f"A tiny {config.num_layers}-layer model (D={config.d_model}, N={config.num_heads}, "
         f"K={config.num_kv_heads}) has {n_params:,} parameters; it runs on {device}.")
    tokenizer = ByteTokenizer()
    prompt = tokenizer.encode("The KV cache")
    cached = generate(model, [prompt], max_new_tokens=16)
    naive = generate(model, [prompt], max_new_tokens=16, use_cache=False)
    assert cached.tokens == naive.tokens  # the cache is an optimisation, never a change of output
    text("Greedy generation with and without the KV cache gives the same tokens (random weights, so "
         "the text itself is noise until we load a trained model).")


def review_of_arithmetic_intensity():
    section("review_of_arithmetic_intensity")
    text("Y = X @ W with X (B x D), W (D x F): 2BDF FLOPs over 2BD + 2DF + 2BF bytes in bf16; "
         "when B << D, F the intensity tends to B FLOPs per byte.")


def arithmetic_intensity_of_inference():
    section("arithmetic_intensity_of_inference")
    text("Prefill processes T = S prompt tokens at once (compute-bound); decode processes T = 1 token "
         "per step and must read all weights and the whole KV cache for it (memory-bound).")


def throughput_and_latency():
    section("throughput_and_latency")
    text("Decode is memory-bound: latency per step ~ bytes read / bandwidth, throughput = B / latency.")


def reduce_kv_cache_size():
    section("reduce_kv_cache_size")
    text("GQA, MQA, MLA, sliding windows and cross-layer sharing all shrink the bytes per cached token.")


def quantization():
    section("quantization")
    text("Fewer bits per weight and activation: less memory traffic in memory-bound decode.")


def model_pruning():
    section("model_pruning")
    text("Score layers, heads and MLP channels on calibration data, remove the least important, and "
         "repair the pruned model by distilling the original into it.")


def speculative_sampling():
    section("speculative_sampling")
    text("A cheap draft proposes tokens, the target checks them in one parallel pass; the accept/"
         "resample rule makes the output an exact sample from the target.")


def continuous_batching():
    section("continuous_batching")
    text("Iteration-level scheduling admits new requests at every decode step (Orca).")


def paged_attention():
    section("paged_attention")
    text("Split each sequence's KV cache into fixed-size blocks mapped by a block table (vLLM).")


def summary():
    section("summary")
    text("Inference is memory-bound decode plus compute-bound prefill; shrink bytes (cache, weights), "
         "verify cheap guesses (speculation), and keep the hardware busy under dynamic load.")


if __name__ == "__main__":
    main()
