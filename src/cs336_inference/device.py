"""Where the library runs: pick a device and dtype, choose CPU threads, make runs reproducible, and
describe the machine a number was measured on (`describe_machine`).

CPU first (fp32: the CPUs we teach on have no fast bf16 matmul), CUDA when present (bf16).

Thread policy (`apply_thread_policy`): small work (toy models, unit tests, the lecture's demos) runs on
one thread, because its ops are too small to split and a second thread only adds synchronisation;
large work (the ~90M benchmark model, big matmuls) runs on every core. OpenMP's wait policy (whether an
idle worker sleeps or spins on a core someone else needs) is read from the environment when torch loads;
this module only reports it (`omp_wait_policy`): the CLI applies the package's policy before torch loads
(`workshop/openmp.py`). CS336_NUM_THREADS, else OMP_NUM_THREADS, overrides the count for both.
"""

from __future__ import annotations

import functools
import os
import platform
import random
import re
import sys
import warnings

import numpy as np
import torch

from . import _checks

_KNOWN = ("cuda", "mps", "cpu")
THREAD_ENV_VARS = ("CS336_NUM_THREADS", "OMP_NUM_THREADS")
_MACHINE_THREADS = torch.get_num_threads()  # torch's own default (one per core), before anyone changes it


def get_device(prefer: str | torch.device | None = None) -> torch.device:
    """Return `prefer` if given and available, else the best available: cuda, then mps, then cpu."""
    if prefer is not None:
        _checks.instance("prefer", prefer, (str, torch.device), "a str, torch.device or None")
        try:
            device = torch.device(prefer)
        except RuntimeError:
            device = None
        if device is None or device.type not in _KNOWN:
            raise ValueError(f"prefer={str(prefer)!r} is not a supported device type; allowed: {_KNOWN}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("prefer='cuda' but no CUDA device is available")
        if device.type == "mps" and not (torch.backends.mps.is_available()):
            raise ValueError("prefer='mps' but MPS is not available")
        return device
    env = os.environ.get("CS336_DEVICE")
    if env:
        return get_device(env)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bf16 on accelerators (the inference default), fp32 on the CPU (no fast bf16 kernels here)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "mps":
        return torch.float16
    return torch.float32


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, NumPy and torch; return a CPU `torch.Generator` seeded the same way."""
    _checks.non_negative_int("seed", seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def thread_policy(parallel: bool = False) -> int:
    """Intra-op CPU threads for a workload: CS336_NUM_THREADS, else OMP_NUM_THREADS, else one thread for
    small work (`parallel=False`) and one per core for large work (`parallel=True`)."""
    _checks.boolean("parallel", parallel)
    for var in THREAD_ENV_VARS:
        value = os.environ.get(var, "").strip()
        if value:
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"{var} must be a positive int (a thread count), got {value!r}")
            return int(value)
    return _MACHINE_THREADS if parallel else 1


def apply_thread_policy(parallel: bool = False) -> int:
    """Set torch's intra-op thread count to `thread_policy(parallel)`; return it.

    Warns when more than one thread will run without a wait policy in the environment (OpenMP's own
    spinning default): `python -m cs336_inference` applies the package's, as does
    `cs336_inference.workshop.apply_openmp_policy()` called before torch is imported.
    """
    n = thread_policy(parallel)
    torch.set_num_threads(n)
    if n > 1 and "OMP_WAIT_POLICY" not in os.environ:
        warnings.warn("OpenMP's threads run with its default wait policy (no OMP_WAIT_POLICY), spinning while "
                      "idle, which stalls them when another process holds a core; run through `python -m "
                      "cs336_inference`, call cs336_inference.workshop.apply_openmp_policy() before importing "
                      "torch, or export OMP_WAIT_POLICY=PASSIVE", RuntimeWarning, stacklevel=2)
    return n


def omp_wait_policy() -> str:
    """The wait policy OpenMP runs with, as the environment says ('PASSIVE', 'ACTIVE', or 'default
    (spinning)'); the runtime read it when torch was imported."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    return policy.upper() if policy else "default (spinning)"


def omp_spin_count() -> str:
    """GNU OpenMP's spin count before an idle worker sleeps (GOMP_SPINCOUNT), or 'default'."""
    return os.environ.get("GOMP_SPINCOUNT") or "default"


def thread_report() -> dict:
    """What the CPU threading looks like in this process (for `python -m cs336_inference info`)."""
    return {"torch_threads": torch.get_num_threads(), "policy_small": thread_policy(False),
            "policy_large": thread_policy(True), "omp_wait_policy": omp_wait_policy(),
            "gomp_spincount": omp_spin_count(),
            **{var.lower(): os.environ.get(var) for var in THREAD_ENV_VARS}}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            match = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        if match:
            return match.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def describe_machine(device: torch.device) -> dict:
    """What a reader needs to judge a number: the CPU, cores, threads, OpenMP's wait policy, the load
    average, torch and the device (and the GPU's name and memory on CUDA)."""
    d = {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
         "omp_wait_policy": omp_wait_policy(), "load_avg": load_avg(), "torch": torch.__version__,
         "python": sys.version.split()[0], "platform": platform.platform(), "device": str(device)}
    if device.type == "cuda":
        d["gpu"] = torch.cuda.get_device_name(device)
        d["gpu_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return d


@functools.cache
def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles for bf16 (torch's oneDNN matmuls use them): read once, then cached."""
    return bf16_matmul_unit("cpu").startswith("AMX")


def bf16_matmul_unit(device) -> str:
    """What bf16 matmuls can use here: AMX tiles, AVX-512 BF16 dot products, or neither (a GPU: its name)."""
    device = torch.device(device)
    if device.type != "cpu":
        return torch.cuda.get_device_name(device) if device.type == "cuda" else "n/a"
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return "unknown"
    if "amx_bf16" in flags:
        return "AMX (amx_bf16)"
    if "avx512_bf16" in flags:
        return "AVX-512 BF16 (avx512_bf16)"
    return "none (bf16 is converted to fp32)"
