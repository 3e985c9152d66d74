"""Our own CPU kernels (`cs336_inference/workshop/csrc/*.cpp`), compiled once per machine on first use, beside torch's.

- `int4_gemv`: an int4 matmul for a few rows; `quantization.cpu_int4` runs int4 layers on it.
- `dense_gemv`: the same for fp32 and bf16 weights, read in place; `cpu_tuning.CPULinear` runs a
  decode step's full-precision linears on it (`tune_for_cpu`).
- `decode_attention`: the attention of a decode step's few query rows over every cached key; the
  attention kernel "cpu" (`TransformerLM.set_attention_kernel`) runs it where every key is visible,
  and torch's fused kernel everywhere else (a prefill's masked attention, other dtypes and shapes).

They build only where they can run: an x86 CPU whose flags include avx512_bf16 (Zen 4, Sapphire
Rapids and newer), a C++ compiler (the one torch.compile uses on a CPU) and torch with OpenMP. The
library lands in the package's cache folder, per torch version and per content of its sources
(`_build_key`); later processes only load it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import warnings
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCES = sorted((Path(__file__).parents[1] / "csrc").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parents[1] / "csrc").glob("*.h"))
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp"]


def _headers_flag() -> str:
    """A define naming the headers' contents: torch rebuilds the library when its sources or flags change,
    and does not read the headers they include, so a changed header changes the flags."""
    return f"-DCS336_HEADERS={zlib.crc32(b''.join(h.read_bytes() for h in HEADERS)):08x}"


def _build_key() -> str:
    """What the built library depends on (the sources' and headers' contents, the flags), as a short hash:
    its folder's name. A process finds a library built from exactly its sources and loads it without
    asking torch's extension builder (which runs the build tool to check, every time); checkouts with
    other sources build beside it rather than over it."""
    digest = hashlib.sha256(" ".join(_FLAGS).encode())
    for path in [*SOURCES, *HEADERS]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def cpu_supports() -> str | None:
    """None when this CPU and toolchain can run the kernels, else why not."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return "cannot read /proc/cpuinfo to check for AVX512-BF16"
    if not {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} <= set(flags.split()):
        return "the CPU has no AVX512-BF16 (needs e.g. Zen 4 or Sapphire Rapids)"
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler to build it"
    if not torch.backends.openmp.is_available():
        return "this torch build has no OpenMP"
    return None


@functools.cache
def build() -> str | None:
    """Compile (once per machine) and load the kernels; None, or why they cannot run here."""
    reason = cpu_supports()
    if reason is not None:
        return reason
    from ...progress import ticker
    from ...model.disk_cache import cache_dir

    folder = cache_dir() / "torch_extensions" / f"cpu_kernels-torch{torch.__version__}-{_build_key()}"
    library = folder / "cs336_cpu_kernels.so"
    try:
        torch.ops.load_library(str(library))   # built before from these very sources and flags: just load it
    except (OSError, RuntimeError):             # not built yet (or a damaged file): build it, saying so
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with ticker("building our CPU kernels (once per machine)"), warnings.catch_warnings():
                warnings.simplefilter("ignore")   # torch's notes about the compiler version are not the user's business
                from torch.utils.cpp_extension import load

                load(name="cs336_cpu_kernels", sources=[str(s) for s in SOURCES],
                     extra_cflags=[*_FLAGS, _headers_flag()], build_directory=str(folder), is_python_module=False,
                     verbose=False)
        except Exception as e:  # noqa: BLE001 - any build failure means: use torch's kernels, and say why
            names = " and ".join(s.name for s in SOURCES)
            return f"building {names} failed ({type(e).__name__}: {str(e).strip().splitlines()[-1][:200]})"

    # the output shapes torch.compile traces with
    @torch.library.register_fake("cs336::int4_gemv")
    def _(x, codes, sz, split=True):          # (M, K) -> (M, N), in x's dtype (bf16 or fp32)
        return x.new_empty(x.shape[0], codes.shape[0] * 16)

    @torch.library.register_fake("cs336::dense_gemv")
    def _(x, w, max_rows):                    # (M, K), (N, K) -> (M, N)
        return x.new_empty(x.shape[0], w.shape[0])

    @torch.library.register_fake("cs336::decode_attention")
    def _(q, k, v, scale):                    # (B, K, R, H) -> (B, K, R, Hv)
        return q.new_empty(*q.shape[:3], v.shape[-1])

    return None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float | None) -> torch.Tensor:
    """softmax(q k^T * scale) v: q (B, K, R, H), k (B, K, S, H), v (B, K, S, Hv) -> (B, K, R, Hv).

    Our `decode_attention` where it applies (every key visible, bf16 or fp32 on the CPU, H % 32 == 0, Hv % 16
    == 0, at most 16 query rows per head: a decode step), torch's fused kernel otherwise. Under
    torch.compile the choice is made once, when the step is traced (it reads only shapes and dtypes)."""
    if (mask is None and q.device.type == "cpu" and q.dtype == k.dtype == v.dtype
            and q.dtype in (torch.bfloat16, torch.float32)
            and q.shape[-1] % 32 == 0 and q.shape[-1] <= 256 and v.shape[-1] % 16 == 0 and q.shape[-2] <= 16):
        return torch.ops.cs336.decode_attention(q, k, v, q.shape[-1] ** -0.5 if scale is None else scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


NAME = "cpu"   # the attention kernel's name in the core's registry


def register() -> str:
    """Add `attention` to the core's attention registry as "cpu" (idempotent): `set_attention_kernel("cpu")`
    then runs it, where our kernels build (`build` says why not elsewhere, when the name is chosen)."""
    from ...model.attention import ATTENTION

    ATTENTION.register(NAME, attention, why_unavailable=lambda: build())
    return NAME


__all__ = ["NAME", "SOURCES", "attention", "build", "cpu_supports", "register"]
