"""Run torch's packed kernels over a sweep of shapes, each case in a forked child (a segfault kills only
the child): `python kernel_sweep.py allowed|refused`. Prints one JSON line per case:
{"case": [bits, group, O, I, M], "layout": ..., "outcome": "ok" | "wrong" | "raised" | "crashed"}.

allowed: the shapes `packed_layout` accepts, run through `pack_weight`/`packed_matmul` against a float64
         reference written here (the guard must never let a bad shape through);
refused: the int8 shapes it refuses, run on the raw `torch._weight_int8pack_mm` (do they still misbehave?).
"""

import itertools
import json
import os
import resource
import sys

import torch

torch.set_num_threads(1)   # before any op: no OpenMP pool exists when we fork

from cs336_inference.workshop.kernels import cpu_int4  # noqa: E402
from cs336_inference.quantization.kernels import pack_weight, packed_layout, packed_matmul  # noqa: E402

# Load once, here, what every forked case would load again: our CPU kernels, and torch.compile's
# machinery (a packed weight marks its shapes static for it)
cpu_int4.why_unavailable()
torch._dynamo.mark_static(torch.empty(1))

TOL = 3 * 2.0 ** -8   # bf16 activations, scales and output: relative to sum |x| |w|


def _weights(bits, group, O, I, gen):
    u = torch.randint(0, 2 ** bits, (O, I), generator=gen, dtype=torch.int32)
    s = torch.rand(O, I // group, generator=gen) + 0.5
    c = torch.randn(O, I // group, generator=gen)
    return u, s, c


def _reference(x, u, s, c, group):
    w = u.double() * s.double().repeat_interleave(group, 1) + c.double().repeat_interleave(group, 1)
    return x.double() @ w.T, x.double().abs() @ w.abs().T


def allowed_case(bits, group, O, I, M):
    gen = torch.Generator().manual_seed(O * 1000 + I)
    u, s, c = _weights(bits, group, O, I, gen)
    layout, _ = packed_layout(bits, group, O, I, "cpu")
    x = torch.randn(M, I, generator=gen).bfloat16()
    y = packed_matmul(x, pack_weight(u, s, c, bits, group, layout, "cpu"))
    ref, bound = _reference(x, u, s, c, group)
    return float(((y.double() - ref).abs() / bound.clamp(min=1e-30)).max()) <= TOL


def refused_case(bits, group, O, I, M):
    gen = torch.Generator().manual_seed(O * 1000 + I)
    t = torch.randint(-128, 128, (O, I), generator=gen, dtype=torch.int8)
    s = (torch.rand(O, generator=gen) + 0.5).bfloat16()
    x = torch.randn(M, I, generator=gen).bfloat16()
    y = torch._weight_int8pack_mm(x, t, s)
    ref, bound = _reference(x, t.int(), s.float()[:, None], torch.zeros(O, 1), I)
    return float(((y.double() - ref).abs() / bound.clamp(min=1e-30)).max()) <= TOL


def run_forked(fn, case) -> str:
    pid = os.fork()
    if pid == 0:   # child: no core file, exit code says what happened
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        try:
            os._exit(0 if fn(*case) else 3)
        except Exception:
            os._exit(4)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return "crashed"
    return {0: "ok", 3: "wrong", 4: "raised"}.get(os.WEXITSTATUS(status), "crashed")


def cases():
    int8_dims = (8, 12, 14, 24, 33, 40, 16, 48)
    yield from ((8, I, 24, I, M) for I, M in itertools.product(int8_dims, (1, 2, 3, 4, 16)))   # int8, per channel
    yield from ((8, g, O, 2 * g, M) for g, O, M in itertools.product((16, 32, 64), (16, 24), (1, 3)))  # grouped
    yield from ((4, g, O, 256, M) for g, O, M in itertools.product((32, 128), (8, 16, 48), (1, 5)))


if __name__ == "__main__":
    mode = sys.argv[1]
    for bits, group, O, I, M in cases():
        layout, _ = packed_layout(bits, group, O, I, "cpu")
        if mode == "allowed" and layout is not None:
            outcome = run_forked(allowed_case, (bits, group, O, I, M))
        elif mode == "refused" and layout is None and bits == 8 and group == I:
            outcome = run_forked(refused_case, (bits, group, O, I, M))
        else:
            continue
        print(json.dumps(dict(case=[bits, group, O, I, M], layout=layout, outcome=outcome)), flush=True)
