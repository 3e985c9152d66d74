"""`bench thread_policy`: how OpenMP's waiting and our thread count shape batch-1 decode.

OpenMP reads its wait policy once, when torch loads, so each policy runs in a fresh process (this
module as a script) that times the ~90M model's decode step, eager and compiled, idle and while a busy
loop holds a core, in alternating rounds. Policies: "sleep" (PASSIVE, GOMP_SPINCOUNT=0), a spin of
10000 (the package's earlier setting) and of 300000 (its setting, `openmp.SPIN_COUNT`) before
sleeping, each also without `cpu_tuning`'s drop to one thread under contention, and "spin forever"
(ACTIVE).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import torch   # each child process gets its policy in its environment, before this import

from ... import _checks
from ..openmp import SPIN_COUNT
from ...tables import print_table
from ...timing import load_average
from .base import Benchmark, grouped_bars, spread

def _passive(spins: str, switch: bool = True) -> dict:
    return dict(env={"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": spins}, switch=switch)


POLICIES = {"sleep": _passive("0"),
            "spin 10000": _passive("10000"), "spin 10000, no switch": _passive("10000", switch=False),
            f"spin {SPIN_COUNT}": _passive(SPIN_COUNT), f"spin {SPIN_COUNT}, no switch": _passive(SPIN_COUNT, False),
            "spin forever": dict(env={"OMP_WAIT_POLICY": "ACTIVE"}, switch=True)}
PATHS = ("eager", "compiled")


def measure(run, policies: tuple[str, ...] | None = None) -> dict:
    """Each of `policies` (default: all of POLICIES) in its own process."""
    if run.device.type != "cpu":
        raise ValueError("bench thread_policy measures CPU threading; run it with --device cpu")
    for name in policies or ():
        _checks.one_of("policies[i]", name, POLICIES)
    quick, threads = run.quick, torch.get_num_threads()   # the parallel policy's count
    result = {"threads": threads, "quick": quick, "load_average_start": load_average(), "policies": {}}
    for name, policy in POLICIES.items():
        if policies is not None and name not in policies:
            continue
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        env |= policy["env"] | {"CS336_NUM_THREADS": str(threads)}
        args = [sys.executable, "-m", "cs336_inference.workshop.benchmarks.thread_policy", "--child",
                "--quick" if quick else "--full", "switch" if policy["switch"] else "no-switch"]
        out = subprocess.run(args, env=env, capture_output=True, text=True, check=True, timeout=1800).stdout
        result["policies"][name] = json.loads(out.strip().splitlines()[-1])
        print(f"  {name}: done", flush=True)
    result["load_average_end"] = load_average()
    return result


def _child(quick: bool, switch: bool) -> dict:
    """Runs in a fresh process under one policy: times eager and compiled batch-1 decode, idle and busy."""
    import contextlib

    from ...accounting.model_roofline import decode_step_fn
    from ...device import apply_thread_policy, omp_spin_count, omp_wait_policy
    from ..cpu_tuning import tune_for_cpu
    from ...model.transformer import TransformerLM
    from ...timing import busy_cpu, median_seconds
    from .generation import bench_config, timed_compiled_step

    apply_thread_policy(parallel=True)
    torch.manual_seed(0)
    model = tune_for_cpu(TransformerLM(bench_config(quick=quick)).eval().fuse_projections()
                         .set_attention_kernel("sdpa"), threads=switch)
    compiled = timed_compiled_step(model, switch)
    makers = {"eager": lambda: decode_step_fn(model, 1, 32, 40),
              "compiled": lambda: decode_step_fn(model, 1, 32, 40, compiled)}
    makers["compiled"]()()   # compile outside the timing
    rounds, steps = (1, 5) if quick else (3, 25)
    times = {(cond, path): [] for cond in ("idle", "busy") for path in PATHS}
    for _ in range(rounds):
        for cond in ("idle", "busy"):
            with busy_cpu(1) if cond == "busy" else contextlib.nullcontext():
                time.sleep(0.5)   # the contention meter (re-read every 0.25 s) sees the new state
                for path in PATHS:
                    times[(cond, path)].append(median_seconds(makers[path](), torch.device("cpu"), steps))
    return {"omp_wait_policy": omp_wait_policy(), "gomp_spincount": omp_spin_count(), "switch": switch,
            "threads": torch.get_num_threads(),
            **{f"{cond} {path}": dict(zip(("ms", "ms_min", "ms_max"), spread(t, 1e3)))
               for (cond, path), t in times.items()}}


def _print(result: dict) -> None:
    cells = [f"{c} {p}" for c in ("idle", "busy") for p in PATHS]
    rows = [{"policy": name, **{c: f"{r[c]['ms']:.1f} ({r[c]['ms_min']:.1f}-{r[c]['ms_max']:.1f})" for c in cells}}
            for name, r in result["policies"].items()]
    print_table(rows, [("policy", "policy", None)] + [(c, c, None) for c in cells],
                title=f"\nbatch-1 decode, bench-90m{' (quick: smaller)' if result['quick'] else ''}, "
                      f"{result['threads']} threads, ms/step (min-max over rounds); load average "
                      f"{result['load_average_start']:.2f} at start, {result['load_average_end']:.2f} at the end")


def _plot(result: dict):
    import matplotlib.pyplot as plt

    columns = [f"{c} {p}" for c in ("idle", "busy") for p in PATHS]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    grouped_bars(ax, columns, {name: [r[c]["ms"] for c in columns] for name, r in result["policies"].items()})
    ax.set(ylabel="ms per decode step (lower is better)",
           title=f"OpenMP wait policy and decode threads, batch 1, {result['threads']} threads")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


BENCHMARK = bench_thread_policy = Benchmark("thread_policy", measure, _print, parallel=True,
                                            plots={"thread_policy": _plot})


if __name__ == "__main__":
    if sys.argv[1:2] != ["--child"]:
        sys.exit("run it as: python -m cs336_inference bench thread_policy")
    print(json.dumps(_child(quick=sys.argv[2] == "--quick", switch=sys.argv[3] == "switch")))
