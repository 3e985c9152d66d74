"""CPU decode speed-ups, opt in: `tune_for_cpu(model)` applies them to a model, as `fuse_projections` does.

The model itself is plain PyTorch (`nn.Linear`, one code path on every device). On a CPU, batch-1
decode multiplies a handful of rows by every weight matrix: memory-bound matrix-vector work, which
some BLAS builds run on one thread (MKL did on the AMD machines here), leaving half the bandwidth of a
2-core machine unused, and others spread over every thread (MKL on the Intel Xeon here). The
remedies answer host-side facts (thread count, machine load, this BLAS) that the model must not read:

- few-row split: each full-precision linear splits W's output rows into one block per thread (a free
  view) and lets `bmm` stream the blocks in parallel (same numbers, faster decode). Whether it helps
  depends on the BLAS, so by default `tune_for_cpu` measures it on the model's own weights (one
  batch-1 pass over every linear, split against plain `F.linear`, alternated) and keeps it only where
  it wins (`calibrate_split`; `describe` prints what it measured);
- our few-row kernel: where `workshop.kernels.cpu_attention` builds (a CPU with AVX512-BF16), up to
  `GEMV_MAX_ROWS` rows of fp32 or bf16 (2 of bf16 where the CPU has AMX: `gemv_max_rows`) go through
  its `dense_gemv` instead, eagerly and compiled: each thread streams its own share of W's rows once,
  where torch's few-row products are built for larger problems (`bench generation` measures both);
- streaming matmul: elsewhere, inside a compiled graph (`generation.compile_decode`) one row goes through
  `streaming_matmul` instead, which the compiler turns into one parallel loop that reads each weight
  once. `CPULinear` is the one place in the package that asks whether it is being compiled;
- one thread under contention: while another process keeps a core busy, a decode step runs on one
  thread (`decode_threads`): a chain of short parallel regions waits for its slowest thread, and
  the thread that shares a core stalls every region, while one core nearly saturates memory bandwidth.
  A prefill (compute-bound) is decided separately (`prefill_threads`, `PREFILL_CONTENDED`).
- 2 MB pages: the weights a step streams move into one block of memory on 2 MB pages
  (`huge_pages`), so reading them no longer walks the page tables of ~66,000 4 KB pages per step
  and evicts everything else the step needs from the CPU's address-translation cache.

`tune_for_cpu` is an explicit transform, like `fuse_projections`: it replaces the model's linears with
`CPULinear`s holding the same weights and registers the thread hooks on the model, changes nothing the
model computes (state dict, results to rounding), is idempotent, and records what it applied
(`model.cpu_tuning`; `describe(model)` says it in one line, `workshop.tune` returns that line);
`untune_cpu` undoes it. A compiled step runs
outside the model's hooks' reach, so wrap its calls in `decode_threads()` yourself (`bench generation`).

OpenMP's wait policy is the one CPU setting this module cannot apply: it must be set before torch
loads, so the CLI's entry point applies it (`openmp`, see there for where and why).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from ..device import cpu_has_amx
from ..timing import num_threads

# Rows at or below which the CPU few-row split beats one MKL gemm call (on the weights of the ~90M
# benchmark model, `bench generation`); above it the gemm's own blocking wins.
SPLIT_MAX_ROWS = 64
# Rows up to which our `dense_gemv` runs: on SmolLM2's weights it is far ahead of `F.linear` at one row,
# about even at 16 and behind at 32, where a gemm's blocking reuses each weight for more rows
# (`bench generation`, docs/benchmarks.md).
GEMV_MAX_ROWS = 16
# ... except bf16 on a CPU with AMX tiles, where torch's bf16 matmul (oneDNN) multiplies 16-row tiles
# at once: timed over many separate bf16 weights, ours stays ahead only for the first few rows and
# falls well behind by 8 (a batch-8 bf16 step was slower than fp32's). There it keeps 2 rows.
GEMV_MAX_ROWS_AMX_BF16 = 2


def gemv_max_rows(dtype: torch.dtype) -> int:
    """Rows up to which our `dense_gemv` runs for weights of `dtype` on this CPU (`tune_for_cpu` asks)."""
    return GEMV_MAX_ROWS_AMX_BF16 if dtype == torch.bfloat16 and cpu_has_amx() else GEMV_MAX_ROWS


_SPLIT_ENABLED = True


@contextlib.contextmanager
def few_row_split(enabled: bool):
    """Turn the few-row paths of every `CPULinear` (the split and our `dense_gemv`) on or off, eagerly:
    off, it runs plain `F.linear` (benchmarks compare both)."""
    global _SPLIT_ENABLED
    previous, _SPLIT_ENABLED = _SPLIT_ENABLED, bool(enabled)
    try:
        yield
    finally:
        _SPLIT_ENABLED = previous


def streaming_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # (..., d_in), (d_out, d_in) -> (..., d_out)
    """Rows times W^T written as a multiply and a sum, for a compiled batch-1 decode graph on the CPU.

    Eagerly this would materialise a (d_out, M, d_in) product; under `torch.compile` the multiply and
    the sum fuse into one vectorised loop over W's rows, split across all threads, that reads each
    weight once, where some BLAS builds run a matrix-vector product on one thread. Used for one row only: with a
    batch size that the graph keeps symbolic, the generated loop over M is not vectorised and runs far
    slower than a gemm. Accumulates in fp32 (bf16 weights are upcast inside the loop); the summation
    order differs from a gemm's, so results equal `F.linear`'s to rounding, not bit for bit.
    """
    rows = x.reshape(-1, x.shape[-1])                                     # (M, d_in)
    out = (w.float()[:, None, :] * rows.float()[None]).sum(-1)             # (d_out, M)
    return out.t().reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)


def statically_known_true(x) -> bool:   # noqa: F811 - rebinds itself to torch's at the first call
    """torch's `statically_known_true`, imported at the first call, which then puts it in this name's
    place: its module imports sympy, a slow import that a load which never compiles need not pay."""
    global statically_known_true
    from torch.fx.experimental.symbolic_shapes import statically_known_true as known

    statically_known_true = known
    return known(x)


class CPULinear(nn.Linear):
    """A bias-free `nn.Linear` with the CPU decode paths (same parameters, same state dict).

    With `gemv` (set by `tune_for_cpu` where our CPU kernels build), up to `gemv_max_rows(dtype)` rows
    (16; 2 of bf16 where the CPU has AMX) of fp32 or bf16 without autograd run our `dense_gemv`,
    eagerly and compiled, whatever the thread count (a compiled step whose batch size is a symbol
    calls it for every size; above the bar it runs torch's).
    Otherwise, eagerly, in inference, a few rows on several threads of an uncontended CPU: the output
    rows of W split into one block per thread, streamed in parallel by `bmm` (where `split`, which `tune_for_cpu`
    sets from its calibration). Traced by the compiler, one row without autograd: `streaming_matmul`
    where `split`, and always in bf16, where a dense matmul re-lays out the weight for its bf16 kernel
    on every call. Everything else: `F.linear`.
    """

    split = True
    gemv = False
    bf16_rows = GEMV_MAX_ROWS   # our kernel's bar for bf16 weights (fp32: GEMV_MAX_ROWS), set by `tune_for_cpu`

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_in) -> (..., d_out)
        w = self.weight
        rows = math.prod(x.shape[:-1])
        # Not `rows <= bar`: compiled, a batch size the graph keeps symbolic would get a guard, and a
        # step past it would compile again mid-serving. The kernel itself hands more rows to torch.
        bar = self.bf16_rows if w.dtype == torch.bfloat16 else GEMV_MAX_ROWS
        if (self.gemv and _SPLIT_ENABLED and not statically_known_true(rows > bar) and x.device.type == "cpu"
                and x.dtype == w.dtype and w.dtype in (torch.float32, torch.bfloat16) and w.is_contiguous()
                and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            x2 = x.reshape(rows, x.shape[-1]).contiguous()
            return torch.ops.cs336.dense_gemv(x2, w, bar).reshape(*x.shape[:-1], w.shape[0])
        if torch.compiler.is_compiling():   # a graph must not bake in the thread count
            if ((self.split or w.dtype == torch.bfloat16) and x.device.type == "cpu"
                    and rows == 1 and not torch.is_grad_enabled()):
                return streaming_matmul(x, w)
            return F.linear(x, w)
        return few_row_matmul(x, w) if self.split and _SPLIT_ENABLED else F.linear(x, w)


    @classmethod
    def from_linear(cls, linear: nn.Linear, split: bool, gemv: bool, bf16_rows: int) -> "CPULinear":
        """A `CPULinear` holding `linear`'s weight (the same Parameter: tied weights stay tied, the state
        dict and 2 MB pages are unchanged) and its hooks and mode."""
        new = _copy_as(cls, linear)
        new.split, new.gemv, new.bf16_rows = split, gemv, bf16_rows
        return new

    def to_linear(self) -> nn.Linear:
        """The plain `nn.Linear` holding this layer's weight (`untune_cpu`)."""
        plain = _copy_as(nn.Linear, self)
        for name in ("split", "gemv", "bf16_rows"):
            plain.__dict__.pop(name, None)
        return plain


def _copy_as(cls: type, module: nn.Module) -> nn.Module:
    """A new `cls` module with `module`'s state (parameters, buffers, hooks, mode): shallow, so the tensors
    are shared."""
    new = cls.__new__(cls)
    new.__dict__.update({k: v.copy() if isinstance(v, dict) else v for k, v in module.__dict__.items()})
    return new


def _replace_modules(model: nn.Module, make) -> int:
    """Replace every submodule for which `make(module)` returns a module (one shared in two places is
    replaced by one new module in both); returns how many were replaced."""
    new: dict[int, nn.Module] = {}
    for parent in list(model.modules()):
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            if id(child) not in new:
                made = make(child)
                if made is None:
                    continue
                new[id(child)] = made
            parent._modules[name] = new[id(child)]
    return len(new)


def few_row_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # (..., d_in), (d_out, d_in) -> (..., d_out)
    """x W^T with W's output rows split into one block per thread, streamed in parallel by `bmm`, where
    that applies (a few rows, inference, several threads, an uncontended CPU); `F.linear` elsewhere."""
    P = torch.get_num_threads()
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (P > 1 and 0 < rows <= SPLIT_MAX_ROWS and x.device.type == "cpu"
            and not torch.is_grad_enabled() and w.shape[0] % P == 0 and w.is_contiguous()
            and x.dtype == w.dtype and not cpu_contended()):   # a stalled thread would stall the split
        blocks = w.view(P, w.shape[0] // P, w.shape[1])                       # (P, d_out/P, d_in), free
        x2 = x.reshape(1, rows, x.shape[-1]).expand(P, -1, -1)                # (P, M, d_in)
        y = torch.bmm(x2, blocks.transpose(1, 2))                              # (P, M, d_out/P)
        return rearrange(y, "P M O -> M (P O)").reshape(*x.shape[:-1], w.shape[0])
    return F.linear(x, w)


class _OtherLoad:
    """Cores' worth of CPU time that *other* processes used recently, from Linux's /proc/stat (all
    CPUs' busy time) minus this process's own CPU time (`os.times`), refreshed at most once per
    `interval` seconds. The load average cannot tell our own threads from other people's; this can."""

    def __init__(self, interval: float = 0.25):
        self.interval = interval
        self.last: tuple[float, float, float] | None = None   # (wall, all busy seconds, own seconds)
        self.value: float | None = None
        try:
            self.ticks = os.sysconf("SC_CLK_TCK")
        except (AttributeError, ValueError, OSError):
            self.ticks = None

    def _sample(self) -> tuple[float, float, float] | None:
        if self.ticks is None:
            return None
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)       # idle + iowait
        own = os.times()
        return time.monotonic(), (sum(fields[:8]) - idle) / self.ticks, own.user + own.system

    def __call__(self) -> float | None:
        now = time.monotonic()
        if self.last is not None and now - self.last[0] < self.interval:
            return self.value
        sample = self._sample()
        if sample is not None and self.last is not None:
            wall = sample[0] - self.last[0]
            self.value = max(0.0, ((sample[1] - self.last[1]) - (sample[2] - self.last[2])) / wall)
        self.last = sample if sample is not None else (now, 0.0, 0.0)
        return self.value


other_cpu_load = _OtherLoad()


def cpu_contended(threshold: float = 0.5) -> bool:
    """True when other processes kept at least `threshold` of a core busy over the last second or so
    (False where it cannot be measured). Cheap to call often: it reads /proc at most every 0.25 s."""
    load = other_cpu_load()
    return load is not None and load >= threshold


# Other processes' load (cores) at which a prefill runs on one thread. Prefill is compute-bound: its
# matmuls are long parallel regions, split evenly between the threads, so each waits for the thread
# that shares a core; one thread on the free core does the same work without the wait. Decided
# separately from decode (`decode_threads`), whose short memory-bound regions stall sooner.
PREFILL_CONTENDED = 0.5


def prefill_threads():
    """The thread count a prefill (many tokens at once) should run with, as a context: all of torch's
    threads, or one while other processes keep `PREFILL_CONTENDED` of a core busy."""
    if torch.get_num_threads() > 1 and cpu_contended(PREFILL_CONTENDED):
        return num_threads(1)
    return contextlib.nullcontext()


def decode_threads():
    """The thread count one decode step should run with, as a context: all of torch's threads, or one
    while other processes keep a core busy (`cpu_contended`)."""
    if torch.get_num_threads() > 1 and cpu_contended():
        return num_threads(1)
    return contextlib.nullcontext()


def calibrate_split(linears: list[nn.Linear], rounds: int = 5) -> dict[str, float]:
    """Seconds for one batch-1 pass over `linears` (every weight read once, as a decode step reads them)
    with plain `F.linear` ("gemm") and with the few-row split ("split"): the median of `rounds` rounds
    that alternate the two, so load drifting on a shared machine hits both alike."""
    x = {(lin.in_features, lin.weight.dtype): torch.randn(1, lin.in_features, dtype=lin.weight.dtype)
         for lin in linears}
    times = {"gemm": [], "split": []}
    with torch.no_grad():
        for i in range(rounds + 1):   # round 0 warms up (a BLAS sets up its kernels on first use)
            for kernel, matmul in (("gemm", F.linear), ("split", few_row_matmul)):
                t0 = time.perf_counter()
                for lin in linears:
                    matmul(x[lin.in_features, lin.weight.dtype], lin.weight)
                if i:
                    times[kernel].append(time.perf_counter() - t0)
    return {kernel: statistics.median(ts) for kernel, ts in times.items()}


@dataclass
class CPUTuning:
    """What `tune_for_cpu` applied to a model (kept on it as `model.cpu_tuning`)."""

    split_linears: int = 0      # `CPULinear`s that split (every full-precision linear is one)
    gemv_linears: int = 0       # `CPULinear`s that run our `dense_gemv` for a few rows
    gemv_unavailable: str | None = None   # why our kernel cannot run here, where it was asked for
    threads: bool = False       # decode steps drop to one thread under contention
    calibration: dict | None = None   # split="auto": seconds per batch-1 pass over the weights, per kernel
    huge_pages: str | None = None     # why the streamed weights are not on 2 MB pages, where they were asked to be
    # the hooks' stack of counts to restore, one per thread (a server's compile warms up in a thread of its own)
    _stacks: threading.local = field(default_factory=threading.local, repr=False)

    def __getstate__(self) -> dict:
        # a copy of the model (deepcopy, pickle) starts with empty stacks: a thread-local cannot be copied,
        # and the counts waiting to be restored belong to the threads of the original
        state = dict(self.__dict__)
        state.pop("_stacks")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._stacks = threading.local()

    @property
    def previous_threads(self) -> list:
        """This thread's stack of the counts the hooks restore."""
        if not hasattr(self._stacks, "stack"):
            self._stacks.stack = []
        return self._stacks.stack

    def describe(self) -> str:
        parts = []
        if self.gemv_linears:
            amx = f" (bf16: <= {GEMV_MAX_ROWS_AMX_BF16}, above that torch's AMX matmul)" if cpu_has_amx() else ""
            bits = torch.ops.cs336.dense_gemv_load_bits(-1)   # the kernel is loaded: these linears run it
            parts.append(f"{self.gemv_linears} linears on our few-row kernel ({bits}-bit loads) for <= "
                         f"{GEMV_MAX_ROWS} rows{amx}")
        elif self.gemv_unavailable:
            parts.append(f"torch's matmuls (our few-row kernel cannot run here: {self.gemv_unavailable})")
        measured = ""
        if self.calibration:
            measured = (f" (measured here: {1e3 * self.calibration['split']:.1f} ms split vs "
                        f"{1e3 * self.calibration['gemm']:.1f} ms F.linear per pass over the weights)")
        if self.split_linears:
            where = " (above our kernel's rows)" if self.gemv_linears else " (streamed in a compiled batch-1 step)"
            parts.append(f"{self.split_linears} linears split across threads for <= {SPLIT_MAX_ROWS} rows"
                         f"{where}{measured}")
        elif self.calibration:
            parts.append(f"no few-row split (F.linear is faster with this BLAS){measured}")
        if self.threads:
            parts.append("decode steps and prefills on one thread while another process holds a core")
        if self.huge_pages:
            parts.append(f"weights on ordinary 4 KB pages ({self.huge_pages})")
        return "CPU tuning: " + ("; ".join(parts) if parts else "nothing (not a CPU model)")


def _one_thread_if_contended(model, args, kwargs):
    """Forward pre-hook: under contention a decode step (one new token per sequence) runs on one thread,
    and so does a prefill (more tokens), each by its own threshold."""
    if torch.compiler.is_compiling():   # host-side: a compiled step's caller applies decode_threads
        return
    ids = args[0] if args else kwargs.get("token_ids")
    threads = model.cpu_tuning.previous_threads
    decode = isinstance(ids, torch.Tensor) and ids.shape[-1] == 1
    if (isinstance(ids, torch.Tensor) and torch.get_num_threads() > 1
            and cpu_contended(*(() if decode else (PREFILL_CONTENDED,)))):
        threads.append(torch.get_num_threads())
        torch.set_num_threads(1)
    else:
        threads.append(None)


def _restore_threads(model, args, kwargs, output=None):
    """Forward hook (also run when the forward raises): put the thread count back."""
    if torch.compiler.is_compiling():
        return
    threads = model.cpu_tuning.previous_threads
    previous = threads.pop() if threads else None
    if previous is not None:
        torch.set_num_threads(previous)


def _choose_linear_kernels(linears: list[nn.Linear], split: bool | str, gemv: bool,
                           record: CPUTuning) -> tuple[bool, bool]:
    """(split, gemv) as they will apply to `linears`: "auto" splitting decided by timing both ways on these
    weights (recorded), and gemv only where our kernel builds here (why not, recorded)."""
    if split == "auto":
        split = torch.get_num_threads() > 1 and bool(linears)   # one thread: nothing to split
        if split:
            record.calibration = calibrate_split(linears)
            split = record.calibration["split"] < record.calibration["gemm"]
    if gemv and linears:
        from .kernels.cpu_attention import build

        record.gemv_unavailable = build()
        gemv = record.gemv_unavailable is None
    return split, gemv


def tune_for_cpu(model: nn.Module, split: bool | str = "auto", threads: bool = True,
                 gemv: bool = True, huge_pages: bool = True) -> nn.Module:
    """Apply the CPU decode speed-ups to `model` in place and return it (idempotent; a second call
    with other options replaces the first). split: full-precision bias-free linears become `CPULinear`
    (few-row split eagerly, `streaming_matmul` in a compiled batch-1 step); "auto" (the default) times
    the split against `F.linear` on these weights with the current thread count (`calibrate_split`, a
    fraction of a second) and splits only if it is faster; threads: a decode step runs on one thread
    while another process holds a core; gemv: up to `gemv_max_rows(dtype)` rows run our `dense_gemv` where
    `workshop.kernels.cpu_attention` builds (compiling it the first time on a machine); huge_pages: the weights a
    decode step streams move into one block of 2 MB pages (`huge_pages.place_on_huge_pages`, Linux).
    A model off the CPU is left as it is. Apply it after `fuse_projections` (fusing builds new linears),
    after any dtype change (the timing depends on it) and after quantizing (a quantized layer keeps its
    own kernel, whose layout is what moves to 2 MB pages; quantizing after tuning leaves it on 4 KB pages)."""
    if not isinstance(split, bool) and split != "auto":
        raise TypeError(f"split must be True, False or 'auto', got {type(split).__name__} {split!r}")
    for flag, value in (("threads", threads), ("gemv", gemv), ("huge_pages", huge_pages)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be True or False, got {type(value).__name__} {value!r}")
    untune_cpu(model)
    record = CPUTuning()
    if next(model.parameters()).device.type == "cpu":
        linears = [m for m in model.modules() if type(m) is nn.Linear and m.bias is None]
        split, gemv = _choose_linear_kernels(linears, split, gemv, record)
        bf16_rows = gemv_max_rows(torch.bfloat16)
        # CPULinear either way (a compiled bf16 row streams, see there): each linear is replaced by one
        # holding the same weight, as `fuse_projections` replaces the projections it fuses
        plain = {id(m) for m in linears}
        _replace_modules(model, lambda m: CPULinear.from_linear(m, split, gemv, bf16_rows) if id(m) in plain else None)
        record.split_linears = len(linears) if split else 0
        record.gemv_linears = len(linears) if gemv else 0
        if huge_pages:
            from . import huge_pages as pages

            try:
                pages.place_on_huge_pages(model)
            except RuntimeError as e:   # no 2 MB pages here: the weights stay where they are, and describe says why
                record.huge_pages = str(e)
        if threads:
            model.register_forward_pre_hook(_one_thread_if_contended, with_kwargs=True)
            model.register_forward_hook(_restore_threads, with_kwargs=True, always_call=True)
            record.threads = True
    model.cpu_tuning = record
    return model


def untune_cpu(model: nn.Module) -> nn.Module:
    """Undo `tune_for_cpu`: plain `nn.Linear`s, no thread hooks. Weights on 2 MB pages stay there (it
    changes no result; `.to()` or a copy of the model allocates ordinary memory again)."""
    _replace_modules(model, lambda m: m.to_linear() if type(m) is CPULinear else None)
    for hooks, hook in ((model._forward_pre_hooks, _one_thread_if_contended), (model._forward_hooks, _restore_threads)):
        for key in [k for k, h in hooks.items() if h is hook]:
            del hooks[key]
            model._forward_hooks_with_kwargs.pop(key, None)
            model._forward_pre_hooks_with_kwargs.pop(key, None)
            model._forward_hooks_always_called.pop(key, None)
    model.__dict__.pop("cpu_tuning", None)
    return model


def describe(model: nn.Module) -> str:
    """One line: which CPU speed-ups `model` runs with."""
    record = getattr(model, "cpu_tuning", None)
    if record is None:
        return "CPU tuning: none (plain model)"
    from .huge_pages import huge_page_bytes

    granted = huge_page_bytes(model)   # live: a copy of a tuned model is on ordinary pages again
    return record.describe() + ("" if granted is None else f"; streamed weights in one block, {granted / 1e6:.0f} MB "
                                f"of it on 2 MB pages")


__all__ = ["CPULinear", "CPUTuning", "GEMV_MAX_ROWS", "GEMV_MAX_ROWS_AMX_BF16", "PREFILL_CONTENDED", "SPLIT_MAX_ROWS",
           "calibrate_split", "cpu_contended", "decode_threads", "describe", "few_row_matmul", "few_row_split",
           "gemv_max_rows", "other_cpu_load", "prefill_threads", "streaming_matmul", "tune_for_cpu", "untune_cpu"]
