"""The figure of `bench speculative`: measured vs predicted speed-up over gamma, and alpha by position."""

from __future__ import annotations

from ..figures import save_figure

STYLES = {"draft": "tab:blue", "draft-scratch": "tab:orange", "prompt_lookup": "tab:green"}


def plot_speculative(result: dict, name: str):
    """One panel per (workload, temperature): measured speed-up (markers, min-max bars) and the
    prediction from measured alpha and costs (dashed) for each drafter; a last panel with alpha by
    draft position at the largest gamma."""
    import matplotlib.pyplot as plt

    rows = result["rows"]
    panels = sorted({(r["workload"], r["temperature"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4.2 * (len(panels) + 1), 3.8), squeeze=False)
    for ax, (workload, temperature) in zip(axes[0], panels):
        mine = [r for r in rows if r["workload"] == workload and r["temperature"] == temperature]
        for drafter in dict.fromkeys(r["drafter"] for r in mine):
            rs = sorted((r for r in mine if r["drafter"] == drafter), key=lambda r: r["gamma"])
            color = STYLES.get(drafter)
            g = [r["gamma"] for r in rs]
            m = [r["measured_speedup"] for r in rs]
            err = [[r["measured_speedup"] - r["measured_speedup_min"] for r in rs],
                   [r["measured_speedup_max"] - r["measured_speedup"] for r in rs]]
            ax.errorbar(g, m, yerr=err, marker="o", color=color, label=f"{drafter} measured", capsize=2)
            ax.plot(g, [r["predicted_speedup"] for r in rs], "--", color=color, label=f"{drafter} predicted")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xlabel("gamma (draft tokens per target pass)")
        ax.set_ylabel("decode speed-up over the target alone")
        ax.set_title(f"{workload}, T={temperature:g}")
    axes[0][0].legend(fontsize=7)
    ax = axes[0][-1]
    gamma = max(r["gamma"] for r in rows)
    for r in rows:
        if r["gamma"] == gamma:
            rates = r["acceptance_by_position"]
            ax.plot(range(1, len(rates) + 1), [x if x is not None else float("nan") for x in rates], marker=".",
                    color=STYLES.get(r["drafter"]), ls="-" if r["temperature"] == 0 else ":",
                    label=f"{r['workload']} {r['drafter']} T={r['temperature']:g}")
    ax.set_xlabel("draft position i")
    ax.set_ylabel("P(accept i | 1..i-1 accepted)")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"acceptance by position, gamma={gamma}")
    ax.legend(fontsize=6)
    fig.tight_layout()
    path = save_figure(fig, name)
    plt.close(fig)
    return path
