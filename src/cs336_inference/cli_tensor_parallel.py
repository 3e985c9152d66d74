"""`generate --tensor-parallel-size N`: the prompt is tokenized here, the model runs sharded over N local
worker processes (`parallel.generate_tensor_parallel`, gloo), and rank 0's answer is printed at the end
(not streamed), with the seconds its ranks spent in all-reduces."""

from __future__ import annotations

import sys


def run_generate(args) -> int:
    import torch

    from .model_source import is_path, resolve
    from .parallel import RankFailedError
    from .parallel.generate import generate_tensor_parallel

    if is_path(args.model) or getattr(args, "precision", None) not in (None, "fp32", "bf16"):
        print(f"--tensor-parallel-size runs a named model in fp32 or bf16 (it shards plain weights); got --model "
              f"{args.model} --precision {args.precision}", file=sys.stderr)
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
