"""The figure of `bench quantization_smollm2`: quality against stored bytes, and LLM.int8() outliers per layer."""

from __future__ import annotations

COLORS = {"reference": "black", "cast": "gray", "rtn": "tab:blue", "fp8": "tab:purple", "llm_int8": "tab:brown",
          "q4_1": "tab:pink", "gptq": "tab:orange", "awq": "tab:green", "kv": "tab:cyan"}


def plot_quantization_smollm2(data: dict):
    import matplotlib.pyplot as plt

    rows = data["rows"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.6), gridspec_kw=dict(width_ratios=[1.2, 1]))
    floor = 1e-5
    ys = range(len(rows))
    ax1.barh(ys, [max(r["kl_to_reference"], floor) for r in rows], color=[COLORS[r["family"]] for r in rows])
    for y, r in zip(ys, rows):
        ax1.text(max(r["kl_to_reference"], floor) * 1.15, y, f"{r['model_bytes'] / 1e6:.0f} MB, "
                 f"{r['bits_per_byte']:.3f} bits/byte", va="center", fontsize=7)
    ax1.set_yticks(list(ys), [r["variant"] for r in rows], fontsize=8)
    ax1.invert_yaxis()
    ax1.set(xscale="log", xlim=(floor / 2, 30), xlabel=f"KL(reference || variant), nats/token ({floor:g} = identical)",
            title=f"{data['model']} on held-out English ({data['eval_tokens']} tokens)")
    ax1.grid(alpha=0.3, axis="x")
    layers = range(len(data["outliers"]))
    for kind, color in (("attn_in", "tab:blue"), ("attn_out", "tab:orange"), ("mlp_in", "tab:green"),
                        ("mlp_down", "tab:red")):
        ax2.plot(layers, [l[kind]["outlier_dims"] for l in data["outliers"]], "o-", color=color, label=kind, ms=3)
    ax2.set(xlabel="layer", ylabel=f"feature dims with any |x| > {data['outlier_threshold']:g}",
            title="LLM.int8() outlier dimensions entering each layer's linears")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    return fig
