"""`bench llamacpp`: our engine against llama.cpp on the very same GGUF file.

Both run SmolLM2-135M's published Q4_1 / Q8_0 blocks: ours through `weights="gguf-exact"` (the packed
int4 kernel, our own on AVX512-BF16 CPUs, a compiled decode step, the CPU tuning, a long prefill through
a compiled dequantization and a dense matmul), llama.cpp through `llama-cpp-python` (the
`[peer]` extra). A/B alternated at 1 and 2 threads: batch-1 decode and prefill tokens/s, the bytes a
decode step reads against the bandwidth sampled beside each timing, and same-context next-token
agreement on real text (each engine's argmax after the same prefix, and our fp32 reference's).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

import torch

from ...accounting.model_roofline import decode_step_fn, prefill_tokens_per_second, weight_bytes_per_step
from ...accounting.roofline import bandwidth_probe
from ..cpu_tuning import tune_for_cpu
from ...data.evaluation import decode_kl_to_reference
from ...data.real_text import eval_text_tokens
from ..fast_path import EXACT_ACTIVATIONS, attention_kernel
from ...model.checkpoints import load_pretrained
from ...model.real_models import gguf_path, real_model_missing
from ..kernels.dense_prefill import compile_dense_prefill
from ...tables import print_table
from ...timing import median_seconds, num_threads
from .. import huge_pages
from .base import Benchmark, beside_bandwidth, fraction_of_bandwidth, grouped_bars, spread
from .generation import timed_compiled_step

MODEL = "smollm2-135m"
INSTALL = ('pip install -e ".[peer]" (builds llama-cpp-python from source, a few minutes; '
           'CMAKE_ARGS="-DGGML_NATIVE=ON" for this CPU\'s instructions)')


def llama_cpp_missing() -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f"llama-cpp-python is not installed: {INSTALL}"
    return real_model_missing(MODEL)


def repacking_works() -> bool:
    """Whether llama.cpp survives its default weight repacking here. On some AMX CPUs the AMX buffer it
    repacks Q4_1 into segfaults in the first matmul (ggml-org/llama.cpp#20824), which would take this
    process down with it, so a child process tries one evaluation first."""
    code = (f"import llama_cpp; llama_cpp.Llama(model_path={str(gguf_path(MODEL))!r}, n_ctx=64, n_threads=1, "
            f"verbose=False).eval([1, 2, 3])")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=300).returncode == 0


def _llama(threads: int, context: int, logits_all: bool = False, repack: bool = True):
    """llama.cpp on the GGUF; repack=False loads the weights as stored (no extra buffer types: no AMX or
    CPU repacking), a model parameter llama-cpp-python's constructor does not expose."""
    import llama_cpp.llama as llama_module
    from llama_cpp import Llama

    defaults = llama_module.llama_cpp.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = repack
        return p
    llama_module.llama_cpp.llama_model_default_params = params
    try:
        return Llama(model_path=str(gguf_path(MODEL)), n_ctx=context, n_threads=threads, n_threads_batch=threads,
                     n_batch=512, logits_all=logits_all, verbose=False)
    finally:
        llama_module.llama_cpp.llama_model_default_params = defaults


def _llama_decode_seconds(llm, prompt: list[int], steps: int) -> float:
    llm.reset()
    llm.eval(prompt)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        llm.eval([prompt[-1]])
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:] or times)


def _llama_prefill_tokens_per_s(llm, prompt: list[int], repeats: int) -> float:
    def run():
        llm.reset()
        llm.eval(prompt)
    return len(prompt) / median_seconds(run, torch.device("cpu"), repeats, warmup=1)


def _agreement(ids: torch.Tensor, exact, reference, repack: bool) -> dict:
    """Same-context next-token agreement over the positions of ids (T,): llama.cpp, ours, fp32."""
    llm = _llama(torch.get_num_threads(), ids.numel() + 8, logits_all=True, repack=repack)
    llm.reset()
    llm.eval(ids.tolist())
    peer = torch.from_numpy(llm.scores[: ids.numel()].copy()).argmax(-1)
    with torch.inference_mode():
        ref = reference(ids[None])[0].argmax(-1)
        cache = exact.new_cache(1, ids.numel())
        ours = torch.cat([exact(ids[None, t:t + 1], cache=cache)[0] for t in range(ids.numel())]).argmax(-1)
    kl, top1 = decode_kl_to_reference(exact, reference, ids[None])
    n = ids.numel()
    return dict(positions=n, ours_vs_llamacpp=int((ours == peer).sum()), fp32_vs_llamacpp=int((ref == peer).sum()),
                ours_vs_fp32=int((ours == ref).sum()), kl_ours_to_fp32=kl, top1_ours_vs_fp32=top1)


def measure(run, threads: tuple[int, ...] = (1, 2)) -> dict | None:
    missing = llama_cpp_missing()
    if missing:
        print(f"bench llamacpp skipped: {missing}")
        return None
    quick = run.quick
    rounds, steps, prompt_len, context = (1, 8, 64, 64) if quick else (5, 24, 128, 256)
    # as `chat` runs it: its activations, attention, CPU tuning and, where its int4 kernel takes bf16, a
    # prefill above DENSE_ROWS rows via a compiled dequantization
    exact = load_pretrained(MODEL, weights="gguf-exact", dtype=getattr(torch, EXACT_ACTIVATIONS))
    exact = tune_for_cpu(exact.set_attention_kernel(attention_kernel("cpu")))
    if exact.dtype != torch.float32:   # fp32 activations on our kernel take it at every row count
        exact = compile_dense_prefill(exact)
    reference = load_pretrained(MODEL)
    text = eval_text_tokens(MODEL, 4 * prompt_len)
    prompt = text[:prompt_len].tolist()
    repack = repacking_works()
    if not repack:
        print("llama.cpp's weight repacking (its AMX buffer) crashes on this CPU: llama.cpp runs the weights as stored")
    agreement = _agreement(text[prompt_len:2 * prompt_len], exact, reference, repack)
    del reference
    ours_step = timed_compiled_step(exact)
    peers = {t: _llama(t, context + steps + 8, repack=repack) for t in threads}
    t0 = time.perf_counter()
    decode_step_fn(exact, 1, context, 8, ours_step)()                  # compiles (or reuses the disk cache)
    compile_s = time.perf_counter() - t0
    # sampled beside each decode timing (the host's bandwidth swings), on 2 MB pages as the weights are
    probe = bandwidth_probe(run.device, empty=huge_pages.empty)
    samples = {(e, k, t): [] for e in ("ours", "llama.cpp") for k in ("decode", "prefill_tok_s") for t in threads}
    for _ in range(rounds):                                              # A/B, round after round
        for t in threads:
            with num_threads(t):
                ours = decode_step_fn(exact, 1, context, steps, ours_step)
                samples[("ours", "decode", t)].append(
                    beside_bandwidth(probe, median_seconds, ours, run.device, steps, 2))
                samples[("llama.cpp", "decode", t)].append(
                    beside_bandwidth(probe, _llama_decode_seconds, peers[t], prompt[:context], steps))
                samples[("ours", "prefill_tok_s", t)].append(prefill_tokens_per_second(exact, prompt_len, repeats=2))
                samples[("llama.cpp", "prefill_tok_s", t)].append(_llama_prefill_tokens_per_s(peers[t], prompt, 2))
    gbps = statistics.median(b for k, pairs in samples.items() if k[1] == "decode" for _, b in pairs) / 1e9
    kv = {"ours": exact.new_cache(1, 1).bytes_per_token * (context + 1),
          "llama.cpp": 2 * 2 * exact.config.num_layers * exact.config.num_kv_heads * exact.config.head_dim
          * (context + 1)}                                               # its default f16 K and V
    weights = {"ours": weight_bytes_per_step(exact), "llama.cpp": _gguf_bytes_per_step()}
    rows = _rows(samples, threads, {e: weights[e] + kv[e] for e in ("ours", "llama.cpp")})
    import llama_cpp

    return dict(model=MODEL, llama_cpp_python=llama_cpp.__version__, llama_cpp_repacking=repack,
                prompt_len=prompt_len, context=context,
                rounds=rounds, steps=steps, compile_seconds=compile_s, measured_bandwidth_GBps=gbps,
                agreement=agreement, rows=rows, ours=exact.describe())


def _rows(samples: dict, threads: tuple[int, ...], step_bytes: dict[str, int]) -> list[dict]:
    """One row per (thread count, engine) from the (engine, "decode" | "prefill_tok_s", threads) samples, with
    each decode's bytes per step against the bandwidth sampled beside it; ours also as a ratio to llama.cpp."""
    rows = []
    for t in threads:
        for engine in ("ours", "llama.cpp"):
            pairs = samples[(engine, "decode", t)]
            ts = [s for s, _ in pairs]
            rows.append(dict(zip(("decode_ms", "decode_ms_min", "decode_ms_max"), spread(ts, 1e3)), engine=engine,
                             threads=t, decode_tok_s=1 / statistics.median(ts), bytes_per_step=step_bytes[engine],
                             prefill_tok_s=statistics.median(samples[(engine, "prefill_tok_s", t)]),
                             fraction_of_bandwidth=fraction_of_bandwidth(step_bytes[engine], pairs)))
    for t in threads:
        ours, peer = (next(r for r in rows if r["threads"] == t and r["engine"] == e) for e in ("ours", "llama.cpp"))
        ours["decode_vs_llamacpp"] = peer["decode_ms"] / ours["decode_ms"]
        ours["prefill_vs_llamacpp"] = ours["prefill_tok_s"] / peer["prefill_tok_s"]
    return rows


def _gguf_bytes_per_step() -> int:
    """llama.cpp reads every stored tensor once per decode step (the tied table as the output matmul)."""
    from ...model.gguf import read_gguf

    return sum(int(t.n_bytes) for t in read_gguf(gguf_path(MODEL)).tensors.values())


def _table(result: dict) -> None:
    a = result["agreement"]
    rows = [dict(r, spread=f"{r['decode_ms']:.1f} ({r['decode_ms_min']:.1f}-{r['decode_ms_max']:.1f})",
                 ratio=f"{r['decode_vs_llamacpp']:.2f} / {r['prefill_vs_llamacpp']:.2f}" if "decode_vs_llamacpp" in r
                 else "") for r in result["rows"]]
    peer = result["llama_cpp_python"] + ("" if result.get("llama_cpp_repacking", True) else ", no repacking")
    print_table(rows, [("engine", "engine", None), ("threads", "threads", None),
                       ("decode_tok_s", "decode tok/s", "{:.1f}"), ("spread", "ms (min-max)", None),
                       ("prefill_tok_s", "prefill tok/s", "{:.0f}"),
                       ("bytes_per_step", "MB/step", lambda b: f"{b / 1e6:.1f}"),
                       ("fraction_of_bandwidth", "% of bw", "{:.0%}"), ("ratio", "x llama.cpp (dec / pre)", None)],
                title=f"\n{result['model']} on the same GGUF: ours (int4 exact, compiled) vs llama.cpp "
                      f"{peer}; streaming bandwidth {result['measured_bandwidth_GBps']:.1f} GB/s")
    print(f"same-context next token over {a['positions']} positions: ours = llama.cpp {a['ours_vs_llamacpp']}, "
          f"fp32 reference = llama.cpp {a['fp32_vs_llamacpp']}, ours = fp32 {a['ours_vs_fp32']}; "
          f"KL(fp32 || ours) {a['kl_ours_to_fp32']:.4f} nats/token")


def _plot(result: dict):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "decode_tok_s", "batch-1 decode"), (axes[1], "prefill_tok_s", "prefill")):
        by = {e: [r for r in result["rows"] if r["engine"] == e] for e in ("ours", "llama.cpp")}
        for bars in grouped_bars(ax, [f"{r['threads']} thread(s)" for r in by["ours"]],
                                 {e: [r[key] for r in rows] for e, rows in by.items()}, ("tab:blue", "tab:gray")):
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set(ylabel="tokens/s (higher is better)", title=f"{title}, {result['model']}, same GGUF")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


BENCHMARK = bench_llamacpp = Benchmark("llamacpp", measure, _table, parallel=True, plots={"llamacpp": _plot})
