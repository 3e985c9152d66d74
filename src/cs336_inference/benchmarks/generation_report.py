"""The table and figure of `bench generation` (the experiment itself is in `generation`)."""

from __future__ import annotations

from ..tables import print_table

def print_generation(result: dict) -> None:
    r = result
    print(f"\n{r['preset']} on {r['device']}: {r['parameters']:,} parameters, {r['threads']} thread(s), "
          f"OMP_WAIT_POLICY={r['omp_wait_policy']} (GOMP_SPINCOUNT={r.get('gomp_spincount', '-')}), bf16 matmul "
          f"unit: {r['cpu_bf16_matmul']}; streaming bandwidth (measured in this run) "
          f"{r['measured_bandwidth_GBps']:.1f} GB/s; greedy tokens: fast == plain {r['greedy_fast_equals_plain']}, "
          f"== Hugging Face {r.get('greedy_equals_peer', 'not run (no transformers)')}")
    if r.get("compile_seconds"):
        print("torch.compile time: " + ", ".join(f"{k} {v:.0f} s" for k, v in r["compile_seconds"].items()))
    print_table([dict(row, spread=f"{row['ms_min']:.1f}-{row['ms_max']:.1f}") for row in r["rows"]], [
        ("variant", "variant", None), ("batch", "B", None), ("ms_per_step", "ms/step", "{:.1f}"),
        ("spread", "min-max", None), ("tok_per_s", "tok/s", "{:.1f}"),
        ("weight_bytes_per_step", "MB/step", lambda b: f"{b / 1e6:.1f}"), ("GBps", "GB/s", "{:.1f}"),
        ("fraction_of_bandwidth", "of bw", "{:.0%}"), ("speedup_vs_fp32", "vs fp32", "{:.2f}x"),
        ("speedup_vs_hf_fp32", "vs HF", "{:.2f}x"), ("kl_to_fp32", "KL", "{:.5f}"),
        ("top1_agreement", "top1", "{:.2f}")])
    busy = r["busy"]
    print_table([dict(v, variant=k) for k, v in busy.items() if isinstance(v, dict)],
                [("variant", "variant", None), ("ms_per_step", "ms/step", "{:.1f}"), ("ms_min", "min", "{:.1f}"),
                 ("ms_max", "max", "{:.1f}")],
                title=f"\nbusy (one other process spinning, load {busy['load_average']}), batch 1:")
    states, tie = {True: "met", False: "NOT met", None: "not measured"}, " (a tie: each median in the other's min-max)"
    print_table([dict(v, goal=k, state=states[v["met"]] + (tie if v.get("within_noise") and v["value"] < v["target"]
                                                           else "")) for k, v in r["goals"].items()],
                [("goal", "goal", None), ("value", "value", "{:.2f}"), ("target", "target >=", "{:g}"),
                 ("variant", "measured on", None), ("state", "", None)], title="\ngoals:")
    if "naive_over_cached" in r:
        print(f"\nprefill {r['prefill_tok_per_s_prompt32']:.0f} tok/s (prompt 32); {r['new_tokens']} tokens naive "
              f"{r['naive_generation_s']:.1f} s vs cached {r['cached_generation_s']:.1f} s "
              f"({r['naive_over_cached']:.1f}x)")


def plot_generation(result: dict):
    """Decode tokens/s per variant at batch 1 and 8 (labelled with the speed-up over fp32), and batch-1
    weight bytes per step / step time against the streaming bandwidth measured in the same run.
    Horizontal bars throughout: the variant names read level instead of crowding under the axis."""
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5), sharey=True)
    rows = result["rows"]
    one = [r for r in rows if r["batch"] == 1]
    for ax, B in ((ax1, 1), (ax2, 8)):
        sel = [r for r in rows if r["batch"] == B]
        colors = ["tab:gray" if r["variant"].startswith("HF") else "tab:blue" for r in sel]
        ax.barh([r["variant"] for r in sel], [r["tok_per_s"] for r in sel], color=colors)
        for i, r in enumerate(sel):
            ax.text(r["tok_per_s"], i, f" {r['speedup_vs_fp32']:.2f}x", va="center", fontsize=8)
        ax.set_xlim(0, 1.15 * max(r["tok_per_s"] for r in sel))
        ax.set_xlabel("decode tokens/s (higher is better)")
        ax.set_title(f"Batch {B}: {result['preset']}, {result['device']}, {result['threads']} thread(s)")
    ax3.barh([r["variant"] for r in one], [r["GBps"] for r in one], color="tab:blue", label="weight bytes / step time")
    ax3.axvline(result["measured_bandwidth_GBps"], color="black", ls="--", label="streaming bandwidth (measured)")
    ax3.set_xlabel("GB/s")
    ax3.set_title("Batch-1 decode against the memory roof")
    ax3.legend(fontsize=8, loc="lower right")
    ax1.invert_yaxis()   # shared: the table's order, top to bottom
    fig.tight_layout()
    return fig
