"""The table and figure of `bench generation` (the experiment itself is in `generation`)."""

from __future__ import annotations

def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_generation(result: dict) -> None:
    print(f"\n{result['preset']} on {result['device']}: {result['parameters']:,} parameters, "
          f"{result['threads']} thread(s), OMP_WAIT_POLICY={result['omp_wait_policy']} "
          f"(GOMP_SPINCOUNT={result.get('gomp_spincount', '-')}), bf16 matmul unit: {result['cpu_bf16_matmul']}")
    print(f"streaming bandwidth (measured in this run): {result['measured_bandwidth_GBps']:.1f} GB/s; "
          f"load average {_fmt(result['load_average_start'], '.2f')} at start, "
          f"{_fmt(result['load_average_decode'], '.2f')} after the decode rounds")
    print(f"greedy tokens: fast == plain {result['greedy_fast_equals_plain']}, "
          f"== Hugging Face {result.get('greedy_equals_peer', 'not run (no transformers)')}")
    if result.get("compile_seconds"):
        print("torch.compile time: " + ", ".join(f"{k} {v:.0f} s" for k, v in result["compile_seconds"].items()))
    head = (f"{'variant':<14}{'B':>3}{'ms/step':>9}{'(min-max)':>15}{'tok/s':>8}{'MB/step':>9}{'GB/s':>7}"
            f"{'of bw':>7}{'vs fp32':>8}{'vs HF':>7}{'KL':>9}{'top1':>6}")
    print("\n" + head)
    for r in result["rows"]:
        spread = f"({r['ms_min']:.1f}-{r['ms_max']:.1f})"
        print(f"{r['variant']:<14}{r['batch']:>3}{r['ms_per_step']:>9.1f}"
              f"{spread:>15}{r['tok_per_s']:>8.1f}"
              f"{r['weight_bytes_per_step'] / 1e6:>9.1f}{r['GBps']:>7.1f}{r['fraction_of_bandwidth']:>7.0%}"
              f"{r['speedup_vs_fp32']:>7.2f}x{_fmt(r.get('speedup_vs_hf_fp32'), '>6.2f')}x"
              f"{_fmt(r['kl_to_fp32'], '>9.5f')}{_fmt(r['top1_agreement'], '>6.2f')}")
    busy = result["busy"]
    print(f"\nbusy (one other process spinning, load {_fmt(busy['load_average'], '.2f')}), batch 1:")
    for name, v in busy.items():
        if isinstance(v, dict):
            print(f"  {name:<14} {v['ms_per_step']:8.1f} ms/step ({v['ms_min']:.1f}-{v['ms_max']:.1f})")
    print("\ngoals:")
    for goal, v in result["goals"].items():
        state = {True: "met", False: "NOT met", None: "not measured"}[v["met"]]
        if v.get("within_noise") and v["value"] < v["target"]:
            state += " (a tie: each median inside the other's min-max over rounds)"
        print(f"  {goal:<48} {_fmt(v['value'], '.2f'):>6} (target >= {v['target']:g}, {v['variant']})  {state}")
    if "naive_over_cached" in result:
        print(f"\nprefill {result['prefill_tok_per_s_prompt32']:.0f} tok/s (prompt 32); {result['new_tokens']} tokens "
              f"naive {result['naive_generation_s']:.1f} s vs cached {result['cached_generation_s']:.1f} s "
              f"({result['naive_over_cached']:.1f}x)")


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
