"""The shape every `bench NAME` shares: measure -> JSON (and CSV) -> table -> plots.

A benchmark module ends with one declaration:

    BENCHMARK = Benchmark("accounting", measure, table=print_tables,
                          plots={"{name}_kv_memory": plot_kv_memory})

`BENCHMARK(quick=False, device=None, **options)` picks the device, seeds, applies the thread policy,
calls `measure(run, **options)` and adds where it ran (`machine`: CPU, threads, torch, the load
average at the start and at the end) to the result it returns. Then it writes figures/NAME.json (a
`--quick` run: figures/scratch/NAME_quick.json), prints `table(result)` and saves every
`plots[template](result)` as a PNG. A plot reads nothing but the result, so `replot()` redraws the
committed PNGs from the committed JSON without timing anything (`python -m cs336_inference figures`).
"""

from __future__ import annotations

import csv
import inspect
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...device import describe_machine, get_device, load_avg, seed_everything, thread_policy
from ...figures import load_result, result_path, save_figure, save_json
from ...timing import num_threads


@dataclass
class Run:
    """What `measure` gets: where and how to run, and where outputs go. `measure` may rename the
    result (`bench generation --model X` writes generation_X), mark it partial (`committed=False`:
    one operating point of a sweep goes to the scratch folder, never over the committed result), or
    hand it to another `report` (a Benchmark whose table, CSV and plots present this kind of result:
    `bench inference --endpoint` measures a server, not the sweep)."""

    name: str
    device: torch.device
    quick: bool
    committed: bool = True
    report: Benchmark | None = None

    def path(self, suffix: str, name: str | None = None) -> Path:
        return result_path(name or self.name, suffix, result=self.committed, quick=self.quick)

    def save_figure(self, fig, name: str) -> Path:
        """A figure drawn from live objects (not from the JSON, so `replot` cannot redraw it)."""
        return save_figure(fig, name, result=self.committed, quick=self.quick)


@dataclass(frozen=True)
class Benchmark:
    name: str                                      # `bench NAME`; its result is figures/NAME.json
    measure: Callable[..., dict | None]            # measure(run, **options) -> a JSON-able result
    table: Callable[[dict], None] | None = None    # prints the tables of a result
    plots: dict = field(default_factory=dict)      # PNG name ("{name}" = the result's) -> plot(result) -> figure
    csv: Callable[[dict], list[dict]] | None = None  # one flat row per run, written as NAME.csv
    parallel: bool | Callable[[dict], bool] = False  # every core (large work) or one thread (toy models);
                                                   # a function of the options where they decide
    results: tuple[str, ...] = ()                  # committed results `replot` redraws (default: NAME)

    def options(self) -> dict[str, inspect.Parameter]:
        """The keyword options `measure` takes beyond the run (the CLI refuses any other)."""
        return dict(list(inspect.signature(self.measure).parameters.items())[1:])

    def is_parallel(self, options: dict) -> bool:
        return self.parallel(options) if callable(self.parallel) else self.parallel

    def __call__(self, quick: bool = False, device: str | torch.device | None = None, **options) -> dict | None:
        from ..kernels import register_kernels

        register_kernels()   # a benchmark runs with the workshop's kernels where they run
        run = Run(self.name, get_device(device), quick)
        seed_everything(0)
        cpu = run.device.type == "cpu"
        with num_threads(thread_policy(self.is_parallel(options)) if cpu else torch.get_num_threads()):
            machine, t0 = describe_machine(run.device), time.perf_counter()
            result = self.measure(run, **options)
        if result is None:   # nothing to measure here (it said why); no result is written
            return None
        machine.update(load_avg_end=load_avg(), wall_seconds=time.perf_counter() - t0)
        result = finite(result)
        result.setdefault("quick", quick)
        result["machine"] = machine
        (run.report or self).write(run, result)
        return result

    def write(self, run: Run, result: dict) -> list[Path]:
        """Save the JSON (and CSV), print the tables, draw the plots."""
        paths = [save_json(result, run.name, result=run.committed, quick=run.quick)]
        if self.csv is not None:
            paths.append(save_csv(self.csv(result), run.path(".csv")))
        if self.table is not None:
            self.table(result)
        paths += self.draw(result, run.name, run.save_figure)
        print("wrote " + ", ".join(str(p) for p in paths))
        return paths

    def replot(self) -> list[Path]:
        """Redraw the PNGs of every committed result from its JSON (nothing is timed)."""
        results = {name: load_result(name) for name in self.results or (self.name,)}
        return [path for name, result in results.items() if result is not None
                for path in self.draw(result, name, lambda fig, png: save_figure(fig, png, result=True))]

    def draw(self, result: dict, name: str, save) -> list[Path]:
        """Every plot of `result` that has something to draw, saved with save(figure, png_name)."""
        import matplotlib.pyplot as plt

        paths = []
        for template, plot in self.plots.items():
            fig = plot(result)
            if fig is not None:
                paths.append(save(fig, template.format(name=name, device=result.get("device"))))
                plt.close(fig)
        return paths


def alternate(runs: dict, repeats: int) -> dict[str, list]:
    """Call each of `runs` ({name: fn}) once per round, `repeats` rounds, in order, so that load
    drifting on a shared machine hits every variant alike: {name: [its result in each round]}."""
    out = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            out[name].append(fn())
    return out


def median_repeat(repeats: list[dict], key: str, ranged=()) -> dict:
    """The repeat with the median `key` (the lower middle of an even count), so every number of a row
    comes from one run and stays consistent; with how many repeats there were and each `ranged`
    metric's min and max over them (None where none has a value)."""
    out = {**sorted(repeats, key=lambda r: r[key])[(len(repeats) - 1) // 2], "repeats": len(repeats)}
    for k in ranged:
        values = [r[k] for r in repeats if r[k] is not None and math.isfinite(r[k])]
        out[f"{k}_min"], out[f"{k}_max"] = (min(values), max(values)) if values else (None, None)
    return out


def beside_bandwidth(probe, fn, *args) -> tuple:
    """(fn(*args), the mean of the bandwidth `probe()` sampled just before and just after it): on a shared
    host the bandwidth swings within seconds, so a timing is compared with the bandwidth of its moment."""
    before = probe()
    out = fn(*args)
    return out, (before + probe()) / 2


def fraction_of_bandwidth(nbytes: float, pairs: list[tuple[float, float]]) -> float:
    """Median over rounds of (nbytes / seconds) / bandwidth, from each round's (seconds, bandwidth) pair:
    every ratio is of two things measured together (a ratio of the medians would not be)."""
    return statistics.median(nbytes / seconds / bandwidth for seconds, bandwidth in pairs)


def spread(values: list[float], scale: float = 1.0) -> tuple[float, float, float]:
    """(median, min, max) of `values`, each times `scale` (1e3: seconds -> ms)."""
    return scale * statistics.median(values), scale * min(values), scale * max(values)


def grouped_bars(ax, groups: list[str], series: dict[str, list[float]], colors=None) -> list:
    """Bars of every series side by side within each group (x tick labels: the groups); the bar
    containers, for `ax.bar_label`."""
    width = 0.8 / len(series)
    bars = [ax.bar([j + (k - (len(series) - 1) / 2) * width for j in range(len(groups))], values, width, label=label,
                   color=colors[k] if colors else f"C{k}") for k, (label, values) in enumerate(series.items())]
    ax.set_xticks(range(len(groups)), groups)
    return bars


def finite(value):
    """NaN and inf -> None, recursively: strict JSON has no NaN, and "no value" is what they mean here."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def save_csv(rows: list[dict], path: Path) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    return path


__all__ = ["Benchmark", "Run", "alternate", "beside_bandwidth", "finite", "fraction_of_bandwidth", "grouped_bars",
           "median_repeat", "save_csv", "spread"]
