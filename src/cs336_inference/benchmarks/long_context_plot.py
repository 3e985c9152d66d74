"""The figure of `bench long_context`: accuracy per variant and context (a heat map), and what each
variant's cache costs at the longest context (bars: MB, labelled with accuracy and decode time)."""

from __future__ import annotations

COLORS = {"full": "black", "window": "tab:red", "sinks": "tab:orange", "hybrid": "tab:green", "mqa": "tab:purple",
          "kv": "tab:blue"}


def plot_long_context(data: dict):
    import matplotlib.pyplot as plt

    contexts, rows = data["contexts"], data["rows"]
    names = [r["variant"] for r in rows]
    acc = [[r["accuracy"][str(c)]["accuracy"] for c in contexts] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 0.42 * len(rows) + 1.8),
                                   gridspec_kw=dict(width_ratios=[1, 1.3]))
    ax1.imshow(acc, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
    for i, row in enumerate(acc):
        for j, a in enumerate(row):
            copied = rows[i]["accuracy"][str(contexts[j])]["copied_from_full"]
            ax1.text(j, i, f"{a:.2f}" + ("=" if copied else ""), ha="center", va="center", fontsize=8)
    ax1.set_xticks(range(len(contexts)), [str(c) for c in contexts])
    ax1.set_yticks(range(len(rows)), names, fontsize=8)
    for tick, r in zip(ax1.get_yticklabels(), rows):
        tick.set_color(COLORS[r["family"]])
    ax1.set_xlabel("context (tokens: prompt + answer)")
    ax1.set_title(f"passkey accuracy, {data['trials_per_context']} trials per cell\n(= : window covers the "
                  f"sequence, same as full attention)", fontsize=10)
    longest = str(max(contexts))
    mb = [r["kv_bytes_at_longest"] / 1e6 for r in rows]
    ax2.barh(range(len(rows)), mb, color=[COLORS[r["family"]] for r in rows], alpha=0.75)
    for i, r in enumerate(rows):
        ms = r["decode_ms_at_longest"]
        label = f" acc {r['accuracy'][longest]['accuracy']:.2f}" + (f", {ms['median']:.0f} ms/step" if ms else "")
        ax2.text(mb[i], i, label, va="center", fontsize=8)
    ax2.set_yticks(range(len(rows)), [""] * len(rows))
    ax2.invert_yaxis()
    ax2.set_xlim(0, max(mb) * 1.45)
    ax2.set_xlabel(f"KV cache MB for one {longest}-token sequence (measured on the cache, {data['dtype']})")
    ax2.set_title(f"{data['model']}, post hoc (no retraining): cache size, accuracy and B=1 decode at {longest}",
                  fontsize=10)
    ax1.set_ylim(len(rows) - 0.5, -0.5)
    fig.tight_layout()
    return fig
