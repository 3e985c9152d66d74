"""The model that `chat`, `generate` and `serve` run, set up for speed in one place: which weights
(`--precision`), the packed kernels they choose, the CPU tuning and thread policy, a compiled decode
step where torch can compile (on a CPU, with an int4 model's prefill dequantization compiled too),
and a banner saying what runs.

`load_for_inference` is the one loader the CLI's commands share (the HTTP server calls it too);
`compile_fast` is how this path compiles a decode step (the benchmarks time it too);
`compiled_decode_step` adds the CPU thread switch and an eager fallback; `compiled_engine_decode`
does the same for the serving engine's decode-only steps.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading

from ..progress import mark
from .startup import BackgroundCompile, cached_packed_weights, inductor_cache_dir, use_cache_dirs

PRECISIONS = ("int4-exact", "int8", "bf16", "fp32")
# The activations an int4-exact model runs with unless --dtype says otherwise: fp32. Greedy answers
# follow the argmax, and bf16 activations (8 significant bits) round close logits together and pick
# the wrong one on everyday questions (`bench quality`, the gate the default path must pass). Our int4
# kernel takes fp32 activations as two bf16 halves, near-fp32 sums on codes decoded once.
EXACT_ACTIVATIONS = "float32"

# inductor's options for a compiled step on a CPU:
# - cpp_wrapper: the code that calls the step's ~150 kernels and allocates their outputs is C++; in
#   Python it costs a few ms per step.
# - size_asserts off: that code would check the size and stride of every input and every custom op's
#   output (~400 checks on SmolLM2), and each check builds an error message (a std::stringstream)
#   even when it passes: a small but measurable part of a SmolLM2 step (in-process A/B). The inputs
#   are checked already, before the call, by the compiled step's guards (the ids and the cache), or
#   are the frozen model's own weights; our kernels' output shapes are tested against their declared
#   ones (`cpu_attention.build`).
CPU_INDUCTOR = {"cpp_wrapper": True, "size_asserts": False}


def load_for_inference(name, device=None, precision: str | None = None, dtype=None):
    """(model, tokenizer, banner): a model ready for chat, generate and serve, and one line saying what runs.

    name: a model name, a checkpoint file's path, or a `model_source.ModelSource` (`resolve` gives one:
    a file with its tokenizer and config).

    precision: "int4-exact" (a real model's published Q4_1 / Q8_0 blocks on the packed kernels, no
    re-quantization: the default for a real model), "int8" (per-channel RTN on the packed int8 kernel),
    "bf16" or "fp32" (the toy models' default on a CPU; bf16 on CUDA). Then torch's fused attention
    and, on a CPU, the opt-in CPU tuning (`cpu_tuning.tune_for_cpu`: few-row split, one thread per step
    under contention). The thread policy is applied first (every core for a real model).
    """
    import torch

    from .. import quantization  # noqa: F401  (registers load_pretrained's weights="gguf-exact")
    from ..device import apply_thread_policy, default_dtype, get_device
    from ..model import load_pretrained
    from ..model_source import ModelSource, resolve
    from .kernels import register_kernels

    register_kernels()   # our CPU kernels into the core's registries: int4 layers packed below take ours

    source = name if isinstance(name, ModelSource) else resolve(name)
    name, real = source.name, source.is_real
    mark("imported")
    apply_thread_policy(parallel=real)  # a real model is large work: every core
    device = get_device(device)
    if precision is None:
        precision = "int4-exact" if real else {torch.bfloat16: "bf16"}.get(dtype, "fp32")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "int4-exact":
        if not real:
            raise ValueError(f"--precision int4-exact runs a real model's published GGUF blocks; {name!r} is "
                             f"{'a checkpoint file' if source.path else 'a shipped toy model'} (use fp32, bf16 "
                             f"or int8)")
        activations = dtype or getattr(torch, EXACT_ACTIVATIONS)
        with cached_packed_weights(name, device, activations):   # repacked once, then memory-mapped
            model = load_pretrained(name, device=device, dtype=activations, weights="gguf-exact")
    else:
        base = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(precision) or dtype or default_dtype(device)
        model = source.load(device=device, dtype=dtype or base).fuse_projections()
        if precision == "int8":
            from ..quantization import quantize_model

            model = quantize_model(model, "rtn", bits=8, group_size=None, symmetric=True, quantize_lm_head=True)
    mark("loaded")
    attention = attention_kernel(device)
    model.set_attention_kernel(attention)
    tuning = ""
    if device.type == "cpu":   # opt in to the CPU decode speed-ups, and say so
        from .cpu_tuning import describe, tune_for_cpu

        tuning = "; " + describe(tune_for_cpu(model))
    mark("tuned")
    activations = str(model.dtype).removeprefix("torch.")
    banner = (f"{name}: {precision} weights, {activations} activations{_int4_matmuls(model)} on {device}, "
              f"{torch.get_num_threads()} threads, {attention} attention{tuning}")
    return model, source.tokenizer, banner


def _int4_matmuls(model) -> str:
    """How an int4 model's matmuls take its activations, in words for the banner ("" for other models)."""
    import torch

    from ..quantization import QuantizedLinear
    from .kernels import cpu_int4

    packed = [m.packed_weight() for m in model.modules() if isinstance(m, QuantizedLinear)]
    packed = [p for p in packed if p is not None and p.layout != "int8pack"]
    if not packed:
        return ""
    if not all(p.kernel == cpu_int4.NAME for p in packed):
        return " (int4 matmuls on torch's kernel, with bf16 activations)"
    if model.dtype == torch.float32:
        return " (int4 matmuls on our kernel, each activation split in two bf16 halves: near-fp32 sums)"
    return " (int4 matmuls on our kernel)"


def attention_kernel(device) -> str:
    """The attention the fast path runs: "cpu" (torch's fused kernel, and ours for decode steps:
    `cpu_attention`) on a CPU where our kernels build, else "sdpa"."""
    from ..device import get_device
    from .kernels import register_kernels
    from .kernels.cpu_attention import build

    register_kernels()
    return "cpu" if get_device(device).type == "cpu" and build() is None else "sdpa"


def compile_fast(model):
    """`generation.compile_decode(model)` as the fast path compiles it (the benchmarks time this too):
    CUDA graphs on a GPU; on a CPU, inductor's wrapper in C++ without its size checks (`CPU_INDUCTOR`),
    and `frozen=True`: the fast path never changes its model once loaded, so the step guards on its
    inputs only.

    A bf16 model's linears, where our few-row kernel cannot run, stream their weights inside the graph
    (`cpu_tuning.streaming_matmul`), and
    inductor would fold the RMSNorm before each into that loop, recomputing it for every weight row;
    `realize_cpu_opcount_threshold=1` makes it store the norm's output once instead (the bf16 step runs
    faster; an int4 or fp32 step, whose matmuls are library calls, does not, so it keeps the default)."""
    from ..generation.compiled import compile_decode

    if model.device.type == "cuda":
        return compile_decode(model, mode="reduce-overhead")
    return compile_decode(model, frozen=True, options=_cpu_inductor(model))


def compile_fast_verify(model):
    """`generation.compile_verify(model)` as the fast path compiles it: a speculative pass's T tokens in one
    graph, with `compile_fast`'s settings on a CPU (on a GPU without CUDA graphs: T changes from pass to pass)."""
    from ..generation.compiled import compile_verify

    if model.device.type == "cuda":
        return compile_verify(model)
    return compile_verify(model, frozen=True, options=_cpu_inductor(model))


def _cpu_inductor(model) -> dict:
    """inductor's options for the fast path's graphs on a CPU (see `compile_fast`)."""
    import torch

    from .cpu_tuning import CPULinear

    inductor = dict(CPU_INDUCTOR)
    if any(isinstance(m, CPULinear) and m.weight.dtype == torch.bfloat16 and not m.gemv for m in model.modules()):
        inductor["realize_cpu_opcount_threshold"] = 1
    return inductor


def compiled_decode_step(model):
    """(step(token_ids (B,), cache) -> logits (B, V), what it is), or (None, why not): a `torch.compile`d
    decode step where torch can compile here (CUDA, recorded as CUDA graphs; or a CPU with a C++ compiler).
    Its kernels are cached on disk (`startup.use_cache_dirs`: the package's cache folder), so only the
    first process pays the kernel compile; later ones trace the model again and reuse them. On a CPU each
    step runs under `cpu_tuning.decode_threads` (one thread while another process holds a core).
    On a CPU the step is a `startup.BackgroundCompile`: called as it is, it compiles at its first call;
    after `step.start()` it compiles in a background thread (on a cache of its own) and runs eagerly until
    then."""
    if why_not := _cannot_compile(model):
        return None, why_not
    use_cache_dirs()
    eager = lambda ids, cache: model(ids[:, None], cache=cache)[:, -1]   # noqa: E731
    raw = compile_fast(model)
    what = "compiled decode, CUDA graphs" if model.device.type == "cuda" else "compiled decode"
    how = f"{what}{_dense_prefill(model)} (kernels cached in {_kernel_cache()})"
    if model.device.type == "cuda":   # CUDA graphs record the buffers of the cache they first run on: not a warm-up's
        return _with_fallback(model, raw, eager), how
    step = BackgroundCompile(_with_fallback(model, raw, eager), eager, functools.partial(_prepare_warm_up, model, raw))
    return step, how


def _prepare_warm_up(model, raw_step):
    """For `BackgroundCompile.start`: a cache of the warm-up's own (the size `chat` uses) prefilled with one
    token here, eagerly (through the model's hooks, in the caller's thread), and the warm-up the background
    thread runs: one compiled decode step on it, then the compiled prefill dequantization
    (`warm_dense_prefill`), under inference mode as `generate` and `chat` decode."""
    import torch

    from ..generation import extend
    from .kernels.dense_prefill import warm_dense_prefill

    cache = model.new_cache(1, min(model.config.context_length, 2048))
    extend(model, cache, [0])

    def warm_up():
        with torch.inference_mode(), _quiet_inductor():
            raw_step(torch.zeros(1, dtype=torch.long, device=model.device), cache)
            warm_dense_prefill(model)
    return warm_up


@contextlib.contextmanager
def _quiet_inductor():
    """Drop inductor's remark that a kernel mixes the exact weights' fp16 scales with bf16 activations: a
    note on its code generation, nothing to act on, that would break the lines around it."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="bf16 and fp16 are mixed", category=UserWarning)
        yield


def compiled_engine_decode(model):
    """(decode(token_ids (1, B), step) -> logits (B, V), what it is) for `serving.Engine(decode=...)`, or
    (None, why not): the engine's decode-only steps (one new token per sequence, over the paged cache)
    with every transformer block `torch.compile`d ("regional" compilation). The blocks share one code
    path and the same shapes, so all of them run one compiled graph (one for a single sequence, one for
    several): compiling costs one block's worth, not the whole paged forward's (`bench engine_decode`
    records how long). Dynamic shapes: the batch size and the context length are symbols; no CUDA
    graphs, since the shapes change from step to step. The embedding, the final norm and the head stay
    eager. Same thread switch, fallback, kernel cache and background compile (`startup.BackgroundCompile`:
    after `decode.start()` the server answers with eager steps until the compiled ones are ready) as
    `compiled_decode_step`."""
    import contextlib

    import torch
    from torch.fx.experimental import _config as shapes

    from ..generation.compiled import compile_settings

    if why_not := _cannot_compile(model):
        return None, why_not
    use_cache_dirs()
    options = {} if model.device.type == "cuda" else {"options": dict(CPU_INDUCTOR)}
    # One compiled function for every block: the block comes in as an argument, so its weights are graph
    # inputs rather than constants, and dynamo's cache (kept per code object) serves all the layers.
    block_step = torch.compile(lambda block, *args: type(block).forward(block, *args), **compile_settings(**options))

    compiling = threading.local()   # on in the thread that runs `run` while it runs

    def dispatch(block, *args):
        if getattr(compiling, "on", False):
            return block_step(block, *args)
        return type(block).forward(block, *args)

    @contextlib.contextmanager
    def compiled_blocks():
        # For this step only, and in this thread only: `model.forward` calls each block, which now goes
        # through `block_step`; a prefill, and every other user of the model (another thread too: the
        # server's steps while the background warm-up compiles), runs the eager blocks.
        for block in model.layers:
            block.forward = functools.partial(dispatch, block)
        compiling.on = True
        try:
            yield
        finally:
            compiling.on = False
            for block in model.layers:
                block.__dict__.pop("forward", None)

    def run(ids, step):
        # No "duck sizing": sizes that happen to be equal while tracing (the blocks in a table and the KV
        # heads, say) would become one symbol, and a later step where they differ would compile again.
        with shapes.patch(use_duck_shape=False), compiled_blocks():
            return model(ids, step=step, last_only=True)[0]

    eager = lambda ids, step: model(ids, step=step, last_only=True)[0]   # noqa: E731
    how = (f"compiled decode steps, one graph for every block{_dense_prefill(model)} "
           f"(kernels cached in {_kernel_cache()})")
    decode = BackgroundCompile(_with_fallback(model, run, eager), eager,
                               functools.partial(_prepare_engine_warm_up, model, run), what="the decode steps")
    return decode, how


def _prepare_engine_warm_up(model, run):
    """For `BackgroundCompile.start` of the engine's decode steps: an engine of the warm-up's own (a few KV
    blocks, sharing the model) whose `warm_up` the background thread runs, compiling `run`'s graphs (one
    sequence and several), then the compiled prefill dequantization."""
    import time

    from .kernels.dense_prefill import warm_dense_prefill
    from ..serving import Engine

    engine = Engine(model, clock=time.monotonic, max_num_seqs=2, num_blocks=8, decode=run)

    def warm_up():
        with _quiet_inductor():
            engine.warm_up()
            warm_dense_prefill(model)
    return warm_up


def _dense_prefill(model) -> str:
    """On a CPU, an int4 model's prefill goes through a compiled dequantization + a dense matmul above
    `DENSE_ROWS` rows, or `cpu_int4.DENSE_ROWS` on our kernel (`quantization.compile_dense_prefill`;
    `warm_dense_prefill` compiles it): what that adds to the description, or "" where it does not apply."""
    from .kernels.dense_prefill import compile_dense_prefill, int4pack_layers

    import torch

    from .kernels import cpu_int4

    layers = int4pack_layers(model) if model.device.type == "cpu" else []
    if not layers:
        return ""
    if model.dtype == torch.float32 and all(layer._packed.kernel == cpu_int4.NAME for layer in layers):
        return ", prefill on the same int4 kernel (fp32 activations never take the dense route)"
    compile_dense_prefill(model, warm=False)
    rows = max(layer.dense_above() for layer in layers)   # our CPU kernel keeps a higher bar than torch's
    return f", prefill above {rows} rows: compiled int4 dequantization + dense matmul"


def _cannot_compile(model) -> str | None:
    """Why torch.compile cannot run `model` here, or None."""
    import shutil

    if model.device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "eager decode (torch.compile needs a C++ compiler on a CPU)"
    if model.device.type not in ("cpu", "cuda"):
        return f"eager decode (no torch.compile backend set up for {model.device.type})"
    return None


def _kernel_cache() -> str:
    return str(inductor_cache_dir())


def _with_fallback(model, compiled, eager):
    """`compiled(*args)` under the CPU thread switch; after a compiler failure (said once) `eager(*args)`.
    A ValueError or TypeError is the step refusing its input (torch's compiler raises its own kinds): it
    propagates, and later calls still run compiled."""
    import contextlib

    from .cpu_tuning import decode_threads

    threads = contextlib.nullcontext if model.device.type == "cuda" else decode_threads
    failed = []

    def run(*args):
        with threads():
            if not failed:
                try:
                    return compiled(*args)
                except Exception as error:   # a compiler failure: say so once, then run eagerly
                    if isinstance(error, (ValueError, TypeError)):
                        raise   # bad input, refused by the step's own checks: the compiled path stays
                    failed.append(error)
                    print(f"\n[torch.compile failed ({type(error).__name__}); decoding eagerly]", file=sys.stderr)
            return eager(*args)
    return run
