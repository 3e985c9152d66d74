"""`python -m cs336_inference <command>`: the lecture, training, benchmarks, figures and the homework.

Each subcommand is registered in COMMANDS with a function that adds its arguments and one that
runs it; heavy imports happen inside the runner so `--help` stays instant.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

from . import cli_args as check  # argument types: one-line errors naming the option
from .chat_repl import stats_line  # the line after each answer (chat and generate)
# light: the fast path imports torch and the model at call time
from .workshop.fast_path import PRECISIONS, compiled_decode_step, compiled_engine_decode, load_for_inference

REPO_ROOT = Path(__file__).resolve().parents[2]


def _lecture_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--path", default=None,
                   help="the lecture file to run (default: lecture/lecture_10.py of this checkout, or "
                        "lecture/lecture_10_class.py with --class)")
    p.add_argument("--class", dest="class_path", action="store_true",
                   help="the class path: every official section at about the official length, without the "
                        "deep dives (lecture/lecture_10_class.py)")


def _run_lecture(args) -> int:
    from .device import apply_thread_policy

    if args.path is not None and args.class_path:
        print("lecture: --path and --class name two lecture files; give one", file=sys.stderr)
        return 2
    apply_thread_policy(parallel=False)  # the lecture's models are tiny: one thread (see device.py)
    default = "lecture_10_class.py" if args.class_path else "lecture_10.py"
    path = Path(args.path) if args.path is not None else REPO_ROOT / "lecture" / default
    if not path.is_file():
        print(f"lecture file not found: {path} (run from a source checkout)", file=sys.stderr)
        return 2
    runpy.run_path(str(path), run_name="__main__")
    return 0


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("which", choices=sorted(BENCHMARKS), help="which benchmark to run")
    p.add_argument("--quick", action="store_true",
                   help="smaller sizes, for a smoke run (writes figures/scratch/NAME_quick.*, "
                        "never the committed results)")
    p.add_argument("--device", default=None, type=check.device, help="cpu, cuda or mps (default: best available)")
    # Options only some benchmarks take (refused by the others): bench inference's model and one operating point.
    p.add_argument("--model", default=None, type=check.text,
                   help="inference: the model (target, or smollm2-135m; default "
                   "target); generation, plain_under_load: smollm2-135m instead of the random-init preset")
    p.add_argument("--preset", default=None, type=check.text,
                   help="inference: run only this operating point (chat, batch or rollouts) at every precision "
                   "(default: every operating point and sweep)")
    p.add_argument("--concurrency", type=check.positive_int, default=None,
                   help="inference: with --preset, sequences at once (default: the preset's)")
    p.add_argument("--output-len", type=check.positive_int, default=None,
                   help="inference: with --preset, tokens per answer (default: the preset's)")
    p.add_argument("--no-progress", action="store_true", help="inference: no progress bar over the sweep")
    p.add_argument("--endpoint", default=None, type=check.url,
                   help="inference: measure the OpenAI-compatible server at this URL "
                   "(e.g. http://127.0.0.1:8000/v1; ours, vLLM, SGLang, llama.cpp) with --model its served name "
                   "(default: none, the engine in this process)")
    p.add_argument("--tokenizer", default=None, type=check.text,
                   help="inference --endpoint: cut prompts and count tokens with this "
                   "tokenizer (one of ours, or a tokenizer.json file; default: --model's if ours, else smollm2-135m)")
    p.add_argument("--arrivals", default=None, choices=["poisson", "fixed"],
                   help="inference --endpoint: request arrivals at the workload's rate (default poisson)")
    p.add_argument("--tensor-parallel-size", type=check.positive_int, default=None,
                   help="tensor_parallel, inference: ranks to shard the model over (tensor_parallel default: 2, "
                   "or 3 for smollm2-135m; inference: none, one device only)")


# bench options some benchmarks take (as keywords of their `measure`); the others refuse them
BENCH_OPTIONS = ("model", "preset", "concurrency", "output_len", "endpoint", "tokenizer", "arrivals",
                 "tensor_parallel_size")


def benchmark(name: str):
    """The `Benchmark` of `bench NAME` (benchmarks/NAME.py's BENCHMARK), imported on demand."""
    import importlib

    return importlib.import_module(f"cs336_inference.workshop.benchmarks.{name}").BENCHMARK


def _run_bench(args) -> int:
    from .device import apply_thread_policy

    bench = benchmark(args.which)
    accepted = bench.options()
    kwargs = {}
    for option in BENCH_OPTIONS:
        value = getattr(args, option, None)
        if value is None:
            continue
        if option not in accepted:
            print(f"bench {args.which} does not take --{option.replace('_', '-')}", file=sys.stderr)
            return 2
        kwargs[option] = value
    if getattr(args, "no_progress", False) and "progress" in accepted:
        kwargs["progress"] = False
    apply_thread_policy(parallel=bench.is_parallel(kwargs))
    bench(quick=args.quick, device=args.device, **kwargs)
    return 0


def _train_args(p: argparse.ArgumentParser) -> None:
    from .shipped_models import TRAIN_PRESETS  # light: no training happens at import

    p.add_argument("--preset", required=True, choices=sorted(TRAIN_PRESETS),
                   help="which shipped model to make (target; draft = pruned + distilled target; draft-scratch)")
    p.add_argument("--out", default=None, type=check.text,
                   help="output file (default: a new file ./trained/PRESET.pt; the shipped models in the "
                        "package's assets/ are replaced only if --out names one)")
    p.add_argument("--steps", type=check.positive_int, default=None,
                   help="override the step count (smoke runs only; default: the preset's)")
    p.add_argument("--device", default=None, type=check.device, help="cpu or cuda (default: best available)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def _run_train(args) -> int:
    from .shipped_models import output_path, train_preset

    out = output_path(args.preset, args.out)  # checked before training starts
    _, extra = train_preset(args.preset, out=out, steps=args.steps, device=args.device,
                            progress=not args.no_progress)
    val = extra["val"]
    print(f"{args.preset}: {extra['num_parameters']:,} parameters, val loss {val['loss']:.4f} nats, "
          f"{val['bits_per_byte']:.4f} bits/byte, trained in {extra['train_time_s']:.0f} s; saved to {out}")
    return 0


_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


# an assignment-1 checkpoint's config as flags (ModelConfig fields; --config gives them as a JSON file)
_CONFIG_FLAGS = {"vocab_size": check.positive_int, "context_length": check.positive_int,
                 "d_model": check.positive_int, "num_layers": check.positive_int, "num_heads": check.positive_int,
                 "num_kv_heads": check.positive_int, "d_ff": check.positive_int, "rope_theta": check.positive_float}


def _load_args(p: argparse.ArgumentParser) -> None:
    """Which model and how it loads (chat, generate, serve: `_load_model` reads them)."""
    p.add_argument("--model", default="smollm2-135m", type=check.text,
                   help="smollm2-135m (the real model, from its installed package), a shipped toy model "
                        "(target, draft, draft-scratch), or a checkpoint file: one `train --out` or `save` wrote, "
                        "or an assignment-1 checkpoint (give its config: --config or the flags below)")
    p.add_argument("--device", default=None, type=check.device, help="cpu, cuda or mps (default: best available)")
    p.add_argument("--dtype", default=None, choices=sorted(_DTYPES), help="the activations' dtype (default: fp32 "
                   "for int4-exact, whose int4 kernel takes them as two bf16 halves, near-fp32 and right on close "
                   "calls; bf16 there is the older, less exact path; other precisions: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--precision", default=None, choices=PRECISIONS,
                   help="the weights: int4-exact (the published GGUF blocks on the packed int4 kernel; the default "
                        "for smollm2-135m), int8 (per channel, packed kernel), bf16 or fp32 (the toy models' default)")
    files = p.add_argument_group("a checkpoint file (--model PATH)")
    files.add_argument("--tokenizer", default=None, type=check.text,
                       help="byte (the toy models' byte tokenizer), a model name whose tokenizer to use, or a "
                            "tokenizer.json file (a tokenizer_config.json beside it may give the chat template) "
                            "(default: the one the checkpoint names, else byte when its vocabulary is the byte "
                            "tokenizer's 257 tokens)")
    files.add_argument("--config", default=None, type=check.text,
                       help="an assignment-1 checkpoint's config: a JSON file of ModelConfig fields (vocab_size, "
                            "context_length, d_model, num_layers, num_heads, d_ff, rope_theta); the flags below "
                            "override it (default: none; this project's own checkpoints carry theirs)")
    for flag, kind in _CONFIG_FLAGS.items():
        files.add_argument(f"--{flag.replace('_', '-')}", default=None, type=kind,
                           help=f"the assignment-1 model's {flag} (default: from --config"
                                + {"rope_theta": ", else 10000)", "num_kv_heads": ", else --num-heads)"}.get(flag, ")"))


def _model_args(p: argparse.ArgumentParser) -> None:
    _load_args(p)
    p.add_argument("--max-new-tokens", type=check.positive_int, default=256, help="the longest answer, in tokens")
    p.add_argument("--temperature", type=check.temperature, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=check.positive_int, default=None,
                   help="sample among the k likeliest tokens (default: off, every token)")
    p.add_argument("--top-p", type=check.probability, default=None,
                   help="sample within the smallest set of tokens holding probability p (default: off, 1.0)")
    p.add_argument("--seed", type=check.non_negative_int, default=0, help="sampling seed (temperature > 0)")


def _model_source(args):
    """What --model names (`model_source.resolve`): its tokenizer and, for a file, its config; no weights yet.
    chat, and generate --chat, refuse here a model without a chat template, before anything heavy loads."""
    from .model_source import read_config_file, resolve

    config = read_config_file(args.config) if getattr(args, "config", None) else {}
    config.update({k: getattr(args, k) for k in _CONFIG_FLAGS if getattr(args, k, None) is not None})
    source = resolve(args.model, getattr(args, "tokenizer", None), config)
    if not getattr(source.tokenizer, "chat_template", None):
        if getattr(args, "command", None) == "chat":
            raise ValueError(f"{args.model} has no chat template (it continues text; it was not trained on "
                             f"conversations): continue a text with `generate --model {args.model} --prompt TEXT`, "
                             f"or chat with smollm2-135m")
        if getattr(args, "chat", False):
            raise ValueError(f"--chat: {args.model} has no chat template; drop --chat to continue the prompt as text")
    return source


def _load_model(args):
    from .progress import ticker

    # after a second, a line counting the seconds (importing torch is part of the wait); none for a quick refusal
    with ticker(f"loading {args.model}", quiet_for=1.0):
        import torch

        from .device import seed_everything

        dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
        source = _model_source(args)
        model, tokenizer, banner = load_for_inference(source, args.device, getattr(args, "precision", None), dtype)
    print(banner, file=sys.stderr)
    device = model.device
    generator = seed_everything(args.seed) if device.type == "cpu" else torch.Generator(device).manual_seed(args.seed)
    return model, tokenizer, generator


def _sampling(args, generator) -> dict:
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                generator=generator)


def _generate_args(p: argparse.ArgumentParser) -> None:
    _model_args(p)
    p.add_argument("--prompt", required=True, type=check.text, help="the text to continue")
    p.add_argument("--no-compile", action="store_true", help="decode eagerly (default: a torch.compile'd step "
                   "where torch can compile; the first run compiles, later runs reuse the cached kernels)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message in the model's chat format")
    p.add_argument("--tensor-parallel-size", type=check.positive_int, default=1,
                   help="shard the model over N local worker processes (tensor parallelism, gloo; default 1)")


def _run_generate(args) -> int:
    import time

    if args.tensor_parallel_size > 1:
        from .cli_tensor_parallel import run_generate
        return run_generate(args)

    from .generation import ConversationCache, TextStream, extend, stream
    from .generation.chat import TurnStats
    from .progress import mark

    model, tokenizer, generator = _load_model(args)   # refuses --chat for a model without a chat template
    text = (tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt)
    ids = tokenizer.encode(text)
    room = min(model.config.context_length, len(ids) + args.max_new_tokens)
    if len(ids) >= room:
        print(f"the prompt has {len(ids)} tokens; {args.model} holds {model.config.context_length}", file=sys.stderr)
        return 2
    from .workshop.startup import SHORT_ANSWER_TOKENS

    if args.no_compile or args.max_new_tokens < SHORT_ANSWER_TOKENS:   # a short answer is done before a compile
        decode, how = None, f"eager decode ({'--no-compile' if args.no_compile else 'a short answer'})"
    else:
        decode, how = compiled_decode_step(model)
    conversation = ConversationCache(model, room, decode)
    _compile_first(how, decode, conversation.warm_up, model)   # in the background, or at once where it cannot be
    t0 = time.perf_counter()
    cache = conversation.cache
    logits, out, first, stop = extend(model, cache, ids), TextStream(tokenizer), None, tokenizer.stop_ids
    sampling = _sampling(args, generator)
    sampling["max_new_tokens"] = room - len(ids)
    count = 0
    for token in stream(model, cache, logits, stop_tokens=stop, decode=decode, **sampling):
        if first is None:
            mark("first_token")
        first, count = first or time.perf_counter(), count + 1
        if token not in stop:
            print(out.push(token), end="", flush=True)
    print("\n" + stats_line(TurnStats(len(ids), 0, count, first - t0, time.perf_counter() - first)), file=sys.stderr)
    return 0


def _compile_first(how: str, decode, warm_up, model=None) -> None:
    """Say how the model decodes. A compiled `decode` that can compile in the background (the fast path's
    `startup.BackgroundCompile`) starts doing so, and the model answers eagerly until it is ready; any
    other compiled `decode` compiles now (`warm_up()`, and the model's compiled prefill dequantization,
    `warm_dense_prefill`), with a line counting the seconds."""
    from .workshop.fast_path import _quiet_inductor
    from .progress import mark, ticker
    from .workshop.kernels.dense_prefill import warm_dense_prefill

    if decode is None:
        print(how, file=sys.stderr)
        return
    if getattr(decode, "started", None) is False:
        decode.start()
        print(f"{how}: compiling in the background, decoding eagerly until it is ready", file=sys.stderr)
        return
    with ticker(f"{how}: compiling"), _quiet_inductor():
        warm_up()
        if model is not None:
            warm_dense_prefill(model)
    mark("compiled")


def _chat_args(p: argparse.ArgumentParser) -> None:
    _model_args(p)
    p.epilog = ("In the chat: Ctrl-C stops an answer (the part shown stays in the conversation); at the prompt it "
                "clears the line, or on an empty line ends the chat with exit status 130. Ctrl-D on an empty line "
                "or /quit ends it with status 0. Up/Down recall earlier lines (kept in the cache folder). "
                "/help lists the commands: /reset, /stats, /quit.")
    p.add_argument("--system", default=None, type=check.text, help="a system message (default: the model's own)")
    p.add_argument("--no-compile", action="store_true", help="decode eagerly (default: a torch.compile'd step "
                   "where torch can compile, compiled before the first message)")
    p.add_argument("--tensor-parallel-size", type=check.positive_int, default=1,
                   help="shard the model over N local worker processes (tensor parallelism, gloo): the chat runs "
                   "here, its turns on the engine of rank 0 (default 1)")


def _run_chat(args) -> int:
    if args.tensor_parallel_size > 1:
        from .cli_tensor_parallel import run_chat
        return run_chat(args)
    from .chat_repl import ChatREPL
    from .generation import ConversationCache
    from .serving import ChatSession

    model, tokenizer, _ = _load_model(args)   # a model without a chat template is refused first
    # One user: one contiguous cache kept between turns (each turn prefills only what is new) and a
    # compiled decode step; `serve` is the one that batches conversations on the paged engine.
    decode, how = (None, "eager decode (--no-compile)") if args.no_compile else compiled_decode_step(model)
    max_seq_len = min(model.config.context_length, 2048)
    conversation = ConversationCache(model, max_seq_len, decode)
    _compile_first(how, decode, conversation.warm_up, model)
    session = ChatSession(model, tokenizer, system=args.system, max_seq_len=max_seq_len, streams=conversation)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p)
    print(f"{args.model} on {model.device} ({model.dtype}); /help lists the commands, Ctrl-C stops an answer, "
          f"/quit or Ctrl-D ends.")
    # the loop, its keys and its exit statuses (0: /quit or Ctrl-D; 130: Ctrl-C at an empty prompt): chat_repl.py
    return ChatREPL(session, sampling, args.seed, stats_line).run()


def _serve_args(p: argparse.ArgumentParser) -> None:
    _load_args(p)
    p.add_argument("--host", default="127.0.0.1", type=check.text,
                   help="address to listen on (default: this machine only)")
    p.add_argument("--port", type=check.port, default=8000, help="the port to listen on")
    p.add_argument("--max-num-seqs", type=check.positive_int, default=32, help="sequences in the running batch at most")
    p.add_argument("--num-blocks", type=check.positive_int, default=None,
                   help="KV cache blocks of 16 tokens (default: room for "
                   "max-num-seqs sequences of min(context, 2048) tokens)")
    p.add_argument("--served-model-name", default=None, type=check.text,
                   help="the name clients send as 'model' (default: --model)")
    p.add_argument("--no-compile", action="store_true", help="run every step eagerly (default: the steps that "
                   "only decode run torch.compile'd blocks, compiled before the server starts)")
    p.add_argument("--max-body-bytes", type=check.positive_int, default=4 * 1024 * 1024,
                   help="larger request bodies are refused with HTTP 413 before they are read "
                   "(default: %(default)s, 4 MiB)")
    p.add_argument("--no-access-log", action="store_true",
                   help="do not write one line per request on stderr (status, tokens, TTFT, duration)")
    p.add_argument("--tensor-parallel-size", type=check.positive_int, default=1,
                   help="shard the model over N local worker processes (tensor parallelism, gloo; rank 0 serves "
                   "and schedules, every rank runs its shard of each step; default 1)")
    p.set_defaults(seed=0)


def _run_serve(args) -> int:
    import time

    if args.tensor_parallel_size > 1:
        from .cli_tensor_parallel import run_serve
        return run_serve(args)

    try:
        from .serving.http import OpenAIServer, listen_socket, run_server
    except ImportError as error:
        print(f"serve needs the server extra ({error.name} is missing): pip install -e '.[serve]'", file=sys.stderr)
        return 2
    from .serving import Engine
    from .serving.async_engine import AsyncEngine

    sock = listen_socket(args.host, args.port)   # a busy port is refused now, not after loading the model
    try:
        model, tokenizer, _ = _load_model(args)
        decode, how = (None, "eager decode (--no-compile)") if args.no_compile else compiled_engine_decode(model)
        engine = Engine(model, clock=time.monotonic, max_num_seqs=args.max_num_seqs, num_blocks=args.num_blocks,
                        decode=decode)
        _compile_first(how, decode, engine.warm_up, model)   # before the first client: one sequence and several
        name = args.served_model_name or args.model
        run_server(OpenAIServer(AsyncEngine(engine), tokenizer, name, model.config.context_length), args.host,
                   args.port, sock=sock, access_log=not args.no_access_log, max_body_bytes=args.max_body_bytes)
    finally:
        sock.close()
    return 0


# name -> what it measures; benchmarks/NAME.py declares its BENCHMARK (see benchmarks/base.py)
BENCHMARKS: dict[str, str] = {
    "quality": "SmolLM2-135M on everyday questions, greedy: default path vs fp32 (right answers, loops), "
               "and answers alone vs batched on the engine",
    "generation": "decode speed per precision of a ~90M model (or --model smollm2-135m: also its loading), against HF",
    "roofline": "this machine's roofline, measured, and the bench-90m model on it",
    "accounting": "formulas only: real models on datasheet accelerators",
    "models": "the shipped models side by side",
    "kv_variants": "trains MHA/GQA/MQA/MLA/window/hybrid/CLA: quality, cache bytes, decode time",
    "quantization": "every quantization method on the shipped target",
    "long_context": "SmolLM2-135M: passkey retrieval against post-hoc KV-cache cuts",
    "quantization_smollm2": "every quantization method on SmolLM2-135M and real text",
    "speculative": "plain vs speculative decoding, gamma 1..8, measured and predicted",
    "speculative_draft": "a pruned and distilled SmolLM2 draft (about 30 min)",
    "speculative_heads": "trains SmolLM2's Medusa heads and EAGLE draft by self-distillation (about 25 min on 2 cores)",
    "speculative_proposers": "SmolLM2: Medusa, EAGLE and prompt lookup side by side (part of bench speculative)",
    "serving": "static vs continuous batching, paged vs contiguous KV",
    "serving_speculative": "the engine with and without speculative decoding (prompt lookup, draft model) "
                           "at concurrency 1, 4, 16, 64",
    "inference": "the complete benchmark: operating points and sweeps (--model, --preset)",
    "thread_policy": "OpenMP wait policies, idle vs busy",
    "plain_under_load": "the plain fp32 model's generate, reference vs default (fused) attention, idle vs busy",
    "serving_http": "the engine in process vs behind `serve` (HTTP)",
    "engine_decode": "SmolLM2 on the serving engine: decode steps eager vs compiled (what `serve` runs)",
    "llamacpp": "SmolLM2-135M's GGUF: ours (int4 exact) vs llama.cpp, decode/prefill at 1 and 2 threads ([peer])",
    "alternatives": "trains attention/window/linear attention/SSD/hybrid on MQAR: recall, state bytes, decode time",
    "startup": "cold and warm starts of generate --chat, chat and serve, phase by phase, as real processes",
    "tensor_parallel": "one workload on 1 and on N tensor-parallel ranks (gloo): all-reduce time vs the ring formula",
}


def _info_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parallel", action="store_true", help="apply the policy for large work (every core)")
    p.add_argument("--model", default=None, type=check.text,
                   help="also load this model as chat/generate/serve would and list what runs each layer "
                        "(default: none)")
    p.add_argument("--precision", default=None, choices=PRECISIONS,
                   help="with --model: the weights (default: as for chat)")


def _run_info(args) -> int:
    """Print where the library runs and how it threads (after applying the thread policy)."""
    import torch

    from .device import apply_thread_policy, default_dtype, get_device, thread_report

    apply_thread_policy(parallel=args.parallel)
    device = get_device()
    print(f"device: {device} ({default_dtype(device)})")
    print(f"torch: {torch.__version__}")
    for key, value in thread_report().items():
        print(f"{key}: {value}")
    from .workshop.startup import describe_caches

    print(describe_caches())
    if args.model is not None:   # each layer's kernel, chosen when the model was built (model.describe())
        model, _, banner = load_for_inference(args.model, precision=args.precision)
        print(banner)
        print(model.describe())
    return 0


def _figures_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rerun", action="store_true",
                   help="re-run every benchmark (hours) instead of redrawing the plots from the committed JSON")
    p.add_argument("--quick", action="store_true", help="with --rerun: smaller sizes, for a smoke run")
    p.add_argument("--device", default=None, type=check.device,
                   help="with --rerun: cpu, cuda or mps (default: best available)")


def _run_figures(args) -> int:
    """Redraw every committed figure from its JSON (nothing is timed), or re-run every benchmark."""
    for name in BENCHMARKS:
        if args.rerun or args.quick:
            print(f"\n### bench {name}")
            _run_bench(argparse.Namespace(which=name, quick=args.quick, device=args.device))
        else:
            for path in benchmark(name).replot():
                print("wrote", path)
    return 0


def _homework_args(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", metavar="action", required=True)
    init = actions.add_parser("init", help="write a student package DIR with every graded function's signature, "
                                           "docstring and `raise NotImplementedError`, plus how to grade it")
    init.add_argument("dir", type=check.text, help="the package folder to create (its name is the package name)")
    init.add_argument("--force", action="store_true", help="overwrite the generated files in an existing DIR")


def _run_homework(args) -> int:
    from .homework.skeleton import grade_command, write_skeleton

    try:
        files = write_skeleton(args.dir, force=args.force)
    except ValueError as err:
        print(f"homework init: {err}", file=sys.stderr)
        return 2
    print(f"wrote {len(files)} files to {args.dir}: {', '.join(f.name for f in files)}")
    print(f"grade it with (from any folder): {grade_command(args.dir)}")
    return 0


# name -> (help, add_arguments, run)
COMMANDS: dict[str, tuple] = {
    "lecture": ("run the executable lecture (lecture/lecture_10.py) and print its narration",
                _lecture_args, _run_lecture),
    "train": ("train a shipped model from its preset (--out src/cs336_inference/assets/NAME.pt reproduces it)",
              _train_args, _run_train),
    "bench": ("run a benchmark: prints a table, writes figures/<name>.json and .png",
              _bench_args, _run_bench),
    "figures": ("redraw every figure in figures/ from the committed JSON (--rerun: run every benchmark again)",
                _figures_args, _run_figures),
    "chat": ("chat with a model in the terminal (streams tokens, keeps the KV cache across turns)",
             _chat_args, _run_chat),
    "generate": ("continue one prompt, streaming the tokens (--chat: as a chat message)", _generate_args,
                 _run_generate),
    "serve": ("an OpenAI-compatible HTTP server on the serving engine (/v1/completions, /v1/chat/completions)",
              _serve_args, _run_serve),
    "info": ("print the device, dtype and CPU thread policy this process runs with", _info_args, _run_info),
    "homework": ("the homework: `homework init DIR` writes a student package to implement and grade",
                 _homework_args, _run_homework),
}


def build_parser() -> argparse.ArgumentParser:
    parser = check.Parser(prog="python -m cs336_inference",
                                     description="CS336 Lecture 10 (Inference), executable.")
    parser.add_argument("--version", action="version", version=f"cs336-inference {check.package_version()}",
                        help="print the package's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="command")
    for name, (help_text, add_args, _) in COMMANDS.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command. A mistake in the arguments, or one the library refuses while running (a
    ValueError / TypeError: unknown model, missing device, prompt too long, ...), is one line on
    stderr naming what is wrong, and exit status 2; CS336_DEBUG=1 shows the traceback instead."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:   # a usage error (already printed, one line) or --help
        return exit_.code
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return COMMANDS[args.command][2](args)
    except (ValueError, TypeError, FileNotFoundError, PermissionError) as err:
        if os.environ.get("CS336_DEBUG"):
            raise
        print(f"{parser.prog} {args.command}: error: {check.one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
