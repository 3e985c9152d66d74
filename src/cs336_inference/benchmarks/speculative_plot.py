"""The figure of `bench speculative`: measured vs predicted speed-up over gamma, and alpha by position."""

from __future__ import annotations

from ..figures import save_figure

COLORS = {"draft": "tab:blue", "draft-scratch": "tab:orange", "prompt_lookup": "tab:green"}


def plot_speculative(result: dict, name: str, quick: bool = False):
    """One row per workload: for each temperature, the measured speed-up (markers, min-max bars) and
    the prediction from measured alpha and costs (dashed) per drafter; then alpha by draft position
    at the workload's largest gamma (solid T=0, dotted T=1)."""
    import matplotlib.pyplot as plt

    rows = result["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    temperatures = sorted({r["temperature"] for r in rows})
    ncols = len(temperatures) + 1
    fig, axes = plt.subplots(len(workloads), ncols, figsize=(4.3 * ncols, 3.3 * len(workloads)), squeeze=False)
    for w, workload in enumerate(workloads):
        mine = [r for r in rows if r["workload"] == workload]
        for ax, temperature in zip(axes[w], temperatures):
            for drafter in dict.fromkeys(r["drafter"] for r in mine):
                rs = sorted((r for r in mine if r["drafter"] == drafter and r["temperature"] == temperature),
                            key=lambda r: r["gamma"])
                g = [r["gamma"] for r in rs]
                err = [[r["measured_speedup"] - r["measured_speedup_min"] for r in rs],
                       [r["measured_speedup_max"] - r["measured_speedup"] for r in rs]]
                ax.errorbar(g, [r["measured_speedup"] for r in rs], yerr=err, marker="o", ms=4, capsize=2,
                            color=COLORS.get(drafter), label=f"{drafter} measured")
                ax.plot(g, [r["predicted_speedup"] for r in rs], "--", color=COLORS.get(drafter),
                        label=f"{drafter} predicted")
            ax.axhline(1.0, color="gray", lw=0.8)
            ax.set_title(f"{workload}, T={temperature:g}", fontsize=10)
            ax.set_xlabel("gamma (draft tokens per pass)")
            ax.set_ylabel("speed-up over the target alone")
        axes[w][0].legend(fontsize=7)
        ax = axes[w][-1]
        gamma = max(r["gamma"] for r in mine)
        for r in mine:
            if r["gamma"] == gamma:
                rates = [x if x is not None else float("nan") for x in r["acceptance_by_position"]]
                ax.plot(range(1, len(rates) + 1), rates, marker=".", color=COLORS.get(r["drafter"]),
                        ls="-" if r["temperature"] == 0 else ":", label=f"{r['drafter']} T={r['temperature']:g}")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{workload}: acceptance by position (gamma={gamma})", fontsize=10)
        ax.set_xlabel("draft position i")
        ax.set_ylabel("P(accept i | 1..i-1 accepted)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = save_figure(fig, name, result=True, quick=quick)
    plt.close(fig)
    return path
