"""Benchmarks of the reference implementation (the complete inference benchmark grows here).

`bench_generation`: prefill and decode speed of a ~90M-parameter model whose fp32 weights (~350 MB)
dwarf the CPU caches, so batch-1 decode must stream every weight from memory each step. We report
weight bytes per step / time per step against the streaming bandwidth measured in the same process.
"""

from __future__ import annotations

import statistics

import torch

from ..model.config import ModelConfig
from ..device import default_dtype, get_device, seed_everything
from ..figures import save_figure, save_json
from ..generation.generate import decode_one_token, generate
from ..model.layers import few_row_split
from ..model.transformer import TransformerLM
from ..accounting.roofline import measure_memory_bandwidth
from ..tables import print_mapping
from ..timing import median_seconds


def weight_bytes_per_step(model: TransformerLM) -> int:
    """Bytes of weights one decode step reads: all of them except the embedding table (one row); a tied
    table is still read in full, as the lm_head."""
    return sum(p.nbytes for name, p in model.named_parameters(remove_duplicate=False)
               if not name.startswith("token_embeddings"))


@torch.inference_mode()
def prefill_tokens_per_second(model, prompt_len: int, batch_size: int = 1, repeats: int = 3) -> float:
    device = model.device
    ids = torch.randint(0, model.config.vocab_size, (batch_size, prompt_len), device=device)

    def run():
        model(ids, cache=model.new_cache(batch_size, prompt_len), last_only=True)

    return batch_size * prompt_len / median_seconds(run, device, repeats, warmup=1)


@torch.inference_mode()
def decode_step_seconds(model, batch_size: int, context: int = 32, steps: int = 32) -> float:
    """Median seconds of one decode step for `batch_size` sequences after a `context`-token prefill."""
    device = model.device
    cache = model.new_cache(batch_size, context + steps + 1)  # room for warm-up + timed steps
    model(torch.randint(0, model.config.vocab_size, (batch_size, context), device=device), cache=cache)
    token = torch.zeros(batch_size, dtype=torch.long, device=device)
    return median_seconds(lambda: decode_one_token(model, token, cache), device, steps, warmup=1)


def bench_generation(quick: bool = False, device: str | None = None, preset: str = "bench-90m") -> dict:
    """Prefill tokens/s (prompt 32, 512), decode tokens/s (batch 1, 8), naive vs cached generation of
    128 tokens, and batch-1 decode bandwidth against the measured streaming bandwidth."""
    device = get_device(device)
    seed_everything(0)
    config = ModelConfig.from_name(preset)
    if quick:
        config = config.replace(d_model=256, num_layers=4, num_heads=4, num_kv_heads=2, d_ff=768)
    model = TransformerLM(config, device=device).to(default_dtype(device)).eval()
    new_tokens = 32 if quick else 128
    rows = {"device": str(device), "preset": preset if not quick else f"{preset} (quick: smaller)",
            "threads": torch.get_num_threads(), "parameters": model.num_parameters(),
            "weight_bytes_per_step": weight_bytes_per_step(model)}

    bandwidths = [measure_memory_bandwidth(device, repeats=5) for _ in range(3)]
    rows["measured_bandwidth_GBps"] = statistics.median(bandwidths) / 1e9
    for prompt in (32, 512):
        rows[f"prefill_tok_per_s_prompt{prompt}"] = prefill_tokens_per_second(model, prompt)
    for batch in (1, 8):
        step = decode_step_seconds(model, batch)
        rows[f"decode_ms_per_step_batch{batch}"] = step * 1e3
        rows[f"decode_tok_per_s_batch{batch}"] = batch / step
    with few_row_split(False):  # the plain one-gemm-call path, for comparison
        rows["decode_ms_per_step_batch1_plain_linear"] = decode_step_seconds(model, 1) * 1e3
    step1 = rows["decode_ms_per_step_batch1"] / 1e3
    rows["decode_GBps_batch1"] = rows["weight_bytes_per_step"] / step1 / 1e9
    rows["decode_fraction_of_bandwidth"] = rows["decode_GBps_batch1"] / rows["measured_bandwidth_GBps"]
    rows["decode_GBps_batch1_plain_linear"] = (rows["weight_bytes_per_step"]
                                               / (rows["decode_ms_per_step_batch1_plain_linear"] / 1e3) / 1e9)

    prompt = torch.randint(0, config.vocab_size, (1, 32)).tolist()
    cached = generate(model, prompt, new_tokens, use_cache=True)
    naive = generate(model, prompt, new_tokens, use_cache=False)
    assert cached.tokens == naive.tokens, "cached and naive greedy generation disagree"
    rows["new_tokens"] = new_tokens
    rows["cached_generation_s"] = cached.total_time
    rows["naive_generation_s"] = naive.total_time
    rows["naive_over_cached"] = naive.total_time / cached.total_time

    print_mapping(rows)
    save_json(rows, "generation", result=True, quick=quick)  # --quick: scratch generation_quick.*
    _plot(rows, cached, naive, quick)
    return rows


def _plot(rows: dict, cached, naive, quick: bool) -> None:
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    labels = ["streaming\n(measured)", "decode B=1\n(few-row split)", "decode B=1\n(plain linear)"]
    values = [rows["measured_bandwidth_GBps"], rows["decode_GBps_batch1"], rows["decode_GBps_batch1_plain_linear"]]
    ax1.bar(labels, values, color=["gray", "tab:blue", "tab:orange"])
    ax1.set_ylabel("GB/s")
    ax1.set_title(f"Batch-1 decode of {rows['parameters'] / 1e6:.0f}M params ({rows['device']})")
    ax2.plot([t * 1e3 for t in cached.inter_token_latencies], label="KV cache")
    ax2.plot([t * 1e3 for t in naive.inter_token_latencies], label="naive (re-run prefix)")
    ax2.set_xlabel("generated token")
    ax2.set_ylabel("ms per step")
    ax2.set_title("Per-step latency, batch 1")
    ax2.legend()
    fig.tight_layout()
    save_figure(fig, "generation", result=True, quick=quick)
    plt.close(fig)
