"""`TransformerLM.describe()`: what runs each matmul of a model, one line per kind of layer.

A quantized layer decides its kernel when it is built or moved and reports it (`kernel_summary()`);
full-precision layers are dense matmuls or lookups in their dtype. Layers that differ only in their
block index are listed once, as `layers.*.name (x L)`, so a 30-layer model fits on a screen.
"""

from __future__ import annotations

import re

import torch.nn as nn


def layer_kernels(model: nn.Module) -> dict[str, str]:
    """Module name -> what runs it, for every quantized or full-precision matmul / lookup layer (a tied
    lm_head is listed under its own name too)."""
    found: dict[str, str] = {}
    summarized: list[str] = []
    for name, module in model.named_modules(remove_duplicate=False):
        if any(name.startswith(prefix + ".") for prefix in summarized):
            continue   # the inside of a layer already described (a quantized embedding's table)
        if hasattr(module, "kernel_summary"):
            found[name] = module.kernel_summary()
            summarized.append(name)
        elif isinstance(module, nn.Embedding):
            found[name] = f"lookup ({str(module.weight.dtype).removeprefix('torch.')})"
        elif isinstance(module, nn.Linear):
            found[name] = f"dense matmul ({str(module.weight.dtype).removeprefix('torch.')})"
    return found


def describe(model: nn.Module) -> str:
    """A few lines: the model's activations and, per kind of layer, what runs it."""
    groups: dict[tuple[str, str], int] = {}
    for name, kernel in layer_kernels(model).items():
        key = (re.sub(r"^layers\.\d+\.", "layers.*.", name), kernel)
        groups[key] = groups.get(key, 0) + 1
    header = f"{type(model).__name__} on {getattr(model, 'device', '?')}, {getattr(model, 'dtype', '?')} activations"
    if getattr(model, "quantization", None):
        header += f", quantized: {model.quantization.get('method')}"
    lines = [f"  {name}{f' (x{n})' if n > 1 else ''}: {kernel}" for (name, kernel), n in groups.items()]
    return "\n".join([header, *lines])
