"""docs/benchmarks.md, written from the committed results in figures/*.json (nothing is measured).

One section per result: what its benchmark measures (the first paragraph of the module that declares
it), where and how it ran (the `machine` the scaffold records, and any date the result carries), the
benchmark's own tables as `bench NAME` prints them, and links to its plots. The page is the only place
outside figures/ where measured numbers live; a test regenerates it and fails when the committed page
is stale.

    python -m cs336_inference.workshop.benchmarks.docs_page            # rewrite docs/benchmarks.md
    python -m cs336_inference.workshop.benchmarks.docs_page --check    # exit 1 if it is stale
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import pkgutil
import re
import sys
from pathlib import Path

from ...figures import figures_dir

COMMAND = "python -m cs336_inference.workshop.benchmarks.docs_page"


def benchmarks() -> dict[str, object]:
    """result name -> the `Benchmark` that presents it (tables, plots), over every benchmark module."""
    from . import __path__ as package_path

    owners = {}
    for info in sorted(pkgutil.iter_modules(package_path), key=lambda m: m.name):
        bench = getattr(importlib.import_module(f"{__package__}.{info.name}"), "BENCHMARK", None)
        if bench is not None:
            for result in bench.results or (bench.name,):
                owners.setdefault(result, bench)
    return owners


def _what(bench) -> str:
    """The first paragraph of the docstring of the module that measures `bench`, as one line."""
    module = sys.modules.get(getattr(bench.measure, "__module__", ""), None)
    doc = (getattr(module, "__doc__", None) or "").strip().split("\n\n")[0]
    text = re.sub(r"^`bench \w+`(?: and `bench \w+`)*: ", "", " ".join(doc.split()))
    return text[:1].upper() + text[1:]


def _machine(result: dict) -> list[str]:
    """Where and how the result was measured, from the fields the benchmark scaffold records."""
    m = result.get("machine") or {}
    lines = []
    if m:
        where = [m.get("cpu") or "unknown CPU"]
        if m.get("cpu_count"):
            where.append(f"{m['cpu_count']} cores")
        if m.get("torch_threads"):
            where.append(f"{m['torch_threads']} torch thread{'s' if m['torch_threads'] != 1 else ''}")
        if m.get("device"):
            where.append(f"device {m['device']}")
        if m.get("torch"):
            where.append(f"torch {m['torch']}")
        lines.append("- machine: " + ", ".join(where))
        load = [f"{m['load_avg'][0]:.2f} at the start" if m.get("load_avg") else None,
                f"{m['load_avg_end'][0]:.2f} at the end" if m.get("load_avg_end") else None]
        if any(load):
            lines.append("- load average (1 min): " + ", ".join(x for x in load if x))
        if m.get("wall_seconds"):
            lines.append(f"- wall time: {m['wall_seconds'] / 60:.1f} min")
    else:
        lines.append("- machine: not recorded in the JSON (a result that measures nothing, or an older run)")
    dates = [f"{key} {result[key]}" for key in ("started", "finished", "date") if isinstance(result.get(key), str)]
    lines.append("- date: " + (", ".join(dates) if dates else "not recorded in the JSON (see the file's git history)"))
    if result.get("quick"):
        lines.append("- a `--quick` smoke run, not a full one")
    return lines


def _table(bench, result: dict) -> str:
    out = io.StringIO()
    if bench.table is not None:
        with contextlib.redirect_stdout(out):
            bench.table(result)
    return out.getvalue().rstrip()


def _plots(name: str, bench, result: dict, pngs: set[str]) -> list[str]:
    """The PNG names of `name`'s plots that exist in figures/."""
    drawn = [template.format(name=name, device=result.get("device")) for template in bench.plots]
    return [p for p in dict.fromkeys(drawn) if p in pngs]


def render(directory: Path | None = None) -> str:
    """The whole page, from every figures/*.json in `directory` (default: the checkout's figures/)."""
    directory = directory or figures_dir()
    owners = benchmarks()
    results = {path.stem: json.loads(path.read_text()) for path in sorted(directory.glob("*.json"))}
    pngs = {path.stem for path in directory.glob("*.png")}
    plots = {name: _plots(name, owners[name], result, pngs) for name, result in results.items() if name in owners}
    # plots drawn from live runs (no template): to the result whose name is their longest prefix
    linked = {p for names in plots.values() for p in names}
    for png in sorted(pngs - linked):
        prefixes = [name for name in plots if png == name or png.startswith(name + "_")]
        if prefixes:
            plots[max(prefixes, key=len)].append(png)

    lines = ["# Benchmark results", "",
             "<!-- generated from figures/*.json: do not edit; run "
             f"`{COMMAND}` after a benchmark writes a result -->", "",
             f"Generated from the committed results in [`figures/`](../figures/) by `{COMMAND}` (a test fails "
             "when this page is stale). Each section is one result: what it measures, where it ran, the tables "
             "its `bench NAME` prints, and its plots. `python -m cs336_inference bench NAME` measures again on "
             "your machine (`--quick` for a smoke run into `figures/scratch/`; `CS336_FIGURES=DIR` sends every "
             "output to DIR), and `python -m cs336_inference figures` redraws every plot from its JSON. The "
             "machines these ran on are shared and noisy: compare variants measured side by side in one run, "
             "not numbers across runs. Earlier runs and the experiments behind the defaults: [log.md](log.md).",
             "", "| result | benchmark | what it measures |", "| --- | --- | --- |"]
    for name in results:
        bench = owners.get(name)
        what = _what(bench).replace("|", "\\|") if bench else "no benchmark presents this result"
        lines.append(f"| [{name}](#{name}) | {f'`bench {bench.name}`' if bench else '-'} | {what} |")
    for name, result in results.items():
        bench = owners.get(name)
        lines += ["", f"## {name}", ""]
        if bench is None:
            lines += [f"[`figures/{name}.json`](../figures/{name}.json): no benchmark module declares this result."]
            continue
        lines += [_what(bench), "",
                  f"Written by `python -m cs336_inference bench {bench.name}` to "
                  f"[`figures/{name}.json`](../figures/{name}.json).", ""]
        lines += _machine(result)
        table = _table(bench, result)
        if table:
            lines += ["", "```text", table, "```"]
        for png in plots.get(name, []):
            lines += ["", f"![{png}](../figures/{png}.png)"]
    return "\n".join(lines) + "\n"


def page_path() -> Path:
    return figures_dir().parent / "docs" / "benchmarks.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/benchmarks.md is stale; write nothing")
    args = parser.parse_args(argv)
    path, text = page_path(), render()
    if args.check:
        fresh = path.exists() and path.read_text() == text
        print(f"{path}: {'up to date' if fresh else f'stale: run `{COMMAND}`'}")
        return 0 if fresh else 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
