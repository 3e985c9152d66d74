"""Pictures of a serving run (matplotlib axes in, nothing saved): who waited and who ran when, how
full the batch was, and how much of the KV memory was reserved and actually used over time."""

from __future__ import annotations

from .engine import EngineResult


def plot_timeline(ax, result: EngineResult, title: str = "") -> None:
    """One row per request (by arrival): grey while it waits, coloured from its first step to its
    last token; a dot marks its arrival."""
    outputs = sorted(result.outputs, key=lambda o: o.arrival_time)
    for y, o in enumerate(outputs):
        ax.barh(y, o.first_scheduled_time - o.arrival_time, left=o.arrival_time, height=0.8, color="0.8")
        ax.barh(y, o.finish_time - o.first_scheduled_time, left=o.first_scheduled_time, height=0.8,
                color=f"C{y % 10}")
        ax.plot(o.arrival_time, y, ".", color="k", markersize=2)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("request (by arrival)")
    ax.set_title(title)
    ax.invert_yaxis()


def plot_batch_size(ax, result: EngineResult, label: str, useful_only: bool = True, color: str | None = None) -> None:
    """Sequences running in each step over time (by default without a static batch's padding rows)."""
    times, sizes = [], []
    for r in result.steps:
        times += [r.start, r.end]
        n = r.num_prefills + r.num_decodes - (r.num_padding if useful_only else 0)
        sizes += [n, n]
    ax.plot(times, sizes, label=label, color=color)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("sequences in the step")


def plot_memory(ax, result: EngineResult, label: str, color: str | None = None) -> None:
    """Reserved (dashed) and used (solid) KV slots over time, as a share of the pool."""
    capacity = result.capacity_tokens
    times = [r.end for r in result.steps]
    line, = ax.plot(times, [100 * r.used_tokens / capacity for r in result.steps], color=color,
                    label=f"{label}: used")
    ax.plot(times, [100 * r.reserved_tokens / capacity for r in result.steps], "--", color=line.get_color(),
            label=f"{label}: reserved")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("% of the KV pool")
    ax.set_ylim(0, 105)


__all__ = ["plot_batch_size", "plot_memory", "plot_timeline"]
