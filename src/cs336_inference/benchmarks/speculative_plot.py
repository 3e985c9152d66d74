"""The figures of `bench speculative`: speed-up over gamma per workload, and acceptance by position.

One panel per workload in each figure (two columns), so each reads at lecture size: a drafter is a
colour; greedy (T=0) is measured (solid, min..max bars) next to the prediction from the measured
alpha and costs (dashed); sampling (T=1) is the measured line alone (dotted, hollow markers).
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

COLORS = {"draft": "tab:blue", "draft-scratch": "tab:orange", "prompt_lookup": "tab:green"}
STYLES = [Line2D([], [], color="gray", marker="o", label="T=0 measured"),
          Line2D([], [], color="gray", ls="--", label="T=0 predicted"),
          Line2D([], [], color="gray", ls=":", marker="o", mfc="none", label="T=1 measured")]


def _panels(workloads: list[str], height: float = 3.6):
    cols = min(2, len(workloads))
    fig, axes = plt.subplots(math.ceil(len(workloads) / cols), cols, figsize=(6.2 * cols, height * math.ceil(
        len(workloads) / cols)), squeeze=False)
    for ax in axes.flat[len(workloads):]:
        ax.set_visible(False)
    return fig, axes.flat


def plot_speculative(result: dict):
    rows = result["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = _panels(workloads)
    for ax, workload in zip(axes, workloads):
        mine = [r for r in rows if r["workload"] == workload]
        drafters = list(dict.fromkeys(r["drafter"] for r in mine))
        for drafter in drafters:
            color = COLORS.get(drafter)
            for temperature in sorted({r["temperature"] for r in mine}):
                rs = sorted((r for r in mine if r["drafter"] == drafter and r["temperature"] == temperature),
                            key=lambda r: r["gamma"])
                g, measured = [r["gamma"] for r in rs], [r["measured_speedup"] for r in rs]
                if temperature == 0:
                    err = [[r["measured_speedup"] - r["measured_speedup_min"] for r in rs],
                           [r["measured_speedup_max"] - r["measured_speedup"] for r in rs]]
                    ax.errorbar(g, measured, yerr=err, marker="o", ms=4, capsize=2, color=color)
                    ax.plot(g, [r["predicted_speedup"] for r in rs], "--", color=color)
                else:
                    ax.plot(g, measured, ":", marker="o", ms=4, mfc="none", color=color)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(title=workload, xlabel="gamma (draft tokens per pass)", ylabel="speed-up over the target alone")
        _drafter_legend(ax, drafters)
    fig.legend(handles=STYLES, loc="upper center", ncol=3, fontsize=9, bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def _drafter_legend(ax, drafters, **where) -> None:
    ax.legend(handles=[Line2D([], [], color=COLORS.get(d), lw=3, label=d) for d in drafters], fontsize=8,
              title="drafter", title_fontsize=8, **where)


def plot_acceptance(result: dict):
    """P(accept draft i | drafts 1..i-1 accepted) at each workload's largest gamma (solid T=0, dotted T=1)."""
    rows = result["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = _panels(workloads, height=3.2)
    for ax, workload in zip(axes, workloads):
        mine = [r for r in rows if r["workload"] == workload]
        gamma = max(r["gamma"] for r in mine)
        for r in (r for r in mine if r["gamma"] == gamma):
            rates = [x if x is not None else float("nan") for x in r["acceptance_by_position"]]
            ax.plot(range(1, len(rates) + 1), rates, marker="o", ms=4, color=COLORS.get(r["drafter"]),
                    **({"ls": "-"} if r["temperature"] == 0 else {"ls": ":", "mfc": "none"}))
        ax.set(ylim=(0, 1.3), yticks=[0, 0.2, 0.4, 0.6, 0.8, 1.0], xlim=(0.5, gamma + 0.5),
               title=f"{workload} (gamma = {gamma})", xlabel="draft position i", ylabel="P(accept i | 1..i-1 accepted)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        drafters = list(dict.fromkeys(r["drafter"] for r in mine))
        _drafter_legend(ax, drafters, loc="upper center", ncol=len(drafters))   # above the probabilities
    fig.legend(handles=[STYLES[0], STYLES[2]], labels=["T=0", "T=1"], loc="upper center", ncol=2, fontsize=9,
               bbox_to_anchor=(0.5, 1.0))
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig
