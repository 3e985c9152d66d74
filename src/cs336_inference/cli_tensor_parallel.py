"""`generate --tensor-parallel-size N`: the prompt is tokenized here, the model runs sharded over N local
worker processes (`parallel.generate_tensor_parallel`, gloo), and rank 0's answer is printed at the end
(not streamed), with the seconds its ranks spent in all-reduces.

`serve --tensor-parallel-size N`: this process only watches N ranks (`parallel.launch`); rank 0 runs the
HTTP server around the tensor-parallel engine (`parallel.engine`), the others follow its steps. Ctrl-C or
SIGTERM here stops every rank (rank 0's server drains, then tells the others to stop; any rank still there
after a grace period is killed); a rank that dies stops the others and is named.
"""

from __future__ import annotations

import sys
import time


def _refuse_unsharded(args) -> bool:
    from .model_source import is_path

    if is_path(args.model) or getattr(args, "precision", None) not in (None, "fp32", "bf16"):
        print(f"--tensor-parallel-size runs a named model in fp32 or bf16 (it shards plain weights); got --model "
              f"{args.model} --precision {args.precision}", file=sys.stderr)
        return True
    return False


def _serve_rank(model: str, dtype, host: str, port: int, served_name: str, options: dict, server_options: dict):
    import torch.distributed as dist

    from .model_source import resolve
    from .parallel.engine import sharded_engine

    engine, runner = sharded_engine(model, dtype, clock=time.monotonic, **options)
    if engine is None:
        runner.follow()
        return None
    from .serving.async_engine import AsyncEngine
    from .serving.http import OpenAIServer, listen_socket, run_server

    try:
        sock = listen_socket(host, port)
        engine.warm_up()
        print(f"rank 0 of {dist.get_world_size()}: serving {served_name} on http://{host}:{port}/v1", file=sys.stderr)
        try:
            run_server(OpenAIServer(AsyncEngine(engine), resolve(model).tokenizer, served_name,
                                    engine.model.config.context_length), host, port, sock=sock, **server_options)
        finally:
            sock.close()
    finally:
        runner.stop()
    return runner.communication()


def run_serve(args) -> int:
    import signal

    import torch

    from .parallel import RankFailedError, check_tensor_parallel, launch
    from .parallel.generate import named_config
    from .serving.http import listen_socket

    if _refuse_unsharded(args):
        return 2
    try:
        check_tensor_parallel(named_config(args.model), args.tensor_parallel_size)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    listen_socket(args.host, args.port).close()   # a busy port is refused now, before any rank starts
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype or args.precision)
    options = dict(max_num_seqs=args.max_num_seqs, num_blocks=args.num_blocks)
    server_options = dict(access_log=not args.no_access_log, max_body_bytes=args.max_body_bytes)

    def stop(signum, frame):   # SIGTERM as Ctrl-C: launch stops every rank on the way out
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, stop)
    print(f"{args.model} over {args.tensor_parallel_size} tensor-parallel ranks (gloo on 127.0.0.1)", file=sys.stderr)
    try:
        launch(_serve_rank, args.tensor_parallel_size, args.model, dtype, args.host, args.port,
               args.served_model_name or args.model, options, server_options)
    except RankFailedError as err:
        print(f"error: {str(err).strip().splitlines()[-1]} (rank {err.rank})", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def run_chat(args) -> int:
    from types import SimpleNamespace

    import torch

    from .chat_repl import ChatREPL, stats_line
    from .model_source import resolve
    from .parallel import RankFailedError
    from .parallel.chat import TensorParallelStreams
    from .parallel.generate import named_config
    from .serving import ChatSession
    from .serving.kv_cache_manager import blocks_for

    if _refuse_unsharded(args):
        return 2
    tokenizer = resolve(args.model).tokenizer
    if not getattr(tokenizer, "chat_template", None):
        print(f"chat: {args.model} has no chat template; use generate to continue a text", file=sys.stderr)
        return 2
    config = named_config(args.model)
    max_seq_len = min(config.context_length, 2048)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype or args.precision)
    streams = TensorParallelStreams(args.model, args.tensor_parallel_size, dtype, block_size=16, max_num_seqs=1,
                                    watermark_blocks=0, num_blocks=blocks_for(max_seq_len, 16))
    session = ChatSession(SimpleNamespace(config=config), tokenizer, system=args.system, max_seq_len=max_seq_len,
                          streams=streams)
    sampling = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                    top_p=args.top_p)
    print(f"{args.model} over {args.tensor_parallel_size} tensor-parallel ranks (gloo on 127.0.0.1); /help lists "
          f"the commands, Ctrl-C stops an answer, /quit or Ctrl-D ends.")
    try:
        return ChatREPL(session, sampling, args.seed, stats_line).run()
    except RankFailedError as err:
        print(f"error: {str(err).strip().splitlines()[-1]} (rank {err.rank})", file=sys.stderr)
        return 1
    finally:
        streams.close()


def run_generate(args) -> int:
    import torch

    from .model_source import resolve
    from .parallel import RankFailedError
    from .parallel.generate import generate_tensor_parallel

    if _refuse_unsharded(args):
        return 2
    tokenizer = resolve(args.model).tokenizer
    if args.chat and not getattr(tokenizer, "chat_template", None):
        print(f"--chat: {args.model} has no chat template; drop --chat to continue the prompt as text", file=sys.stderr)
        return 2
    text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    ids = tokenizer.encode(text)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.dtype or args.precision)
    print(f"{args.model} over {args.tensor_parallel_size} tensor-parallel ranks (gloo on 127.0.0.1); "
          f"the answer prints when it is done", file=sys.stderr)
    try:
        out = generate_tensor_parallel(args.model, ids, args.max_new_tokens, args.tensor_parallel_size, dtype=dtype,
                                       seed=args.seed, temperature=args.temperature, top_k=args.top_k,
                                       top_p=args.top_p, stop_tokens=tokenizer.stop_ids or None)
    except RankFailedError as err:
        print(f"error: {str(err).strip().splitlines()[-1]} (rank {err.rank})", file=sys.stderr)
        return 1
    answer = [t for t in out["tokens"] if t not in set(tokenizer.stop_ids or ())]
    print(tokenizer.decode(answer))
    comm = sum(out["communication_s"].values())
    print(f"[{len(out['tokens'])} tokens in {out['seconds']:.2f} s; {out['all_reduces']} all-reduces on rank 0 took "
          f"{comm:.2f} s ({comm / max(out['seconds'], 1e-9):.0%})]", file=sys.stderr)
    return 0
