"""A GGUF model run on the weights it publishes, not on a re-quantization of their dequantized copy.

`load_pretrained(name, weights="gguf-exact")`: every Q4_1 matrix (blocks of 32, w = q d + m) becomes a
`QuantizedLinear` holding the very codes, scales d and minima m (fp16, as stored), which maps onto
torch's int4pack kernel with scale = d and zero = m + 8 d (`kernels`): no new rounding except that the
kernel keeps its scale and zero in the bf16 activation dtype. The Q8_0 embedding table (w = q d, int8
codes) is one `QuantizedLinear` too: a row lookup for the embedding, and, tied, the lm_head, an exact
grouped int8 matmul run as two int4 planes, whose top logits are then rescored in fp32 (`RescoredHead`:
bf16 logits are too coarse to rank close candidates). Norms stay fp32 in the file and take the model's dtype.
The plain `load_pretrained(name)` instead dequantizes everything once to fp32 (the reference).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

from ..model.config import ModelConfig
from ..model.gguf import GGUFBlocks, check_stored_finite, gguf_blocks, gguf_names
from ..model.layers import RotaryEmbedding
from ..model.real_models import register_weights
from ..model.transformer import TransformerLM, uninitialized
from .core import QuantizedTensor
from .kernels import collect_fallbacks
from .linear import QuantizedLinear
from .model import QuantizedEmbedding, RescoredHead, _set, set_quantized_kernel

WEIGHTS_NAME = "gguf-exact"


def exact_linear(blocks: GGUFBlocks, device=None) -> QuantizedLinear:
    """The stored blocks as a `QuantizedLinear` (on `device`) whose dequantized weight equals gguf's
    dequantization bit for bit."""
    in_features = blocks.codes.shape[1]
    group = in_features // blocks.scale.shape[1]
    scale = blocks.scale.to(device)
    zeros = torch.zeros(scale.shape, device=scale.device)
    if blocks.qtype == "Q4_1":
        qt = QuantizedTensor(blocks.codes.to(device), scale, zeros, 4, False, group)
        return QuantizedLinear(qt, scale_dtype=torch.float16, out_dtype=torch.float32,
                               minimum=blocks.minimum.to(device))
    qt = QuantizedTensor(blocks.codes.to(device), scale, zeros, 8, True, group)
    return QuantizedLinear(qt, scale_dtype=torch.float16, out_dtype=torch.float32)


def _stacked_blocks(data: dict, qtypes: dict, names: list[str]) -> GGUFBlocks:
    """The blocks of stored tensors `names` concatenated by rows (a fused q/k/v or w1/w3 projection): exact,
    each row keeps its blocks. The stored bytes are joined first and unpacked once (joining the unpacked
    codes would copy every code once more)."""
    kinds = {qtypes[n] for n in names}
    if len(kinds) != 1:
        raise ValueError(f"cannot fuse projections stored as {dict(zip(names, (qtypes[n] for n in names)))}: "
                         f"fused parts need one block type")
    if len(names) == 1:
        return gguf_blocks(data[names[0]], qtypes[names[0]], names[0])
    parts = [np.asarray(data[n], dtype=np.uint8) for n in names]
    if len({p.shape[1:] for p in parts}) != 1 or any(p.ndim != 2 for p in parts):
        raise ValueError(f"cannot fuse projections {names}: their stored rows differ "
                         f"({[tuple(p.shape) for p in parts]} bytes)")
    return gguf_blocks(np.concatenate(parts), kinds.pop(), " + ".join(names))


def _linear_parts(model: nn.Module, name: str) -> list[str]:
    """CS336 weight keys whose rows make up linear `name` (a fused projection lists its parts)."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if child == "proj" and hasattr(parent, "part_names"):      # FusedLinear: q/k/v or w1/w3
        owner = parent_name.rpartition(".")[0]
        return [f"{owner}.{part}.weight" for part in parent.part_names]
    return [f"{name}.weight"]


@torch.no_grad()
def gguf_exact_model(config: ModelConfig, stored: dict, device=None, dtype: torch.dtype = torch.bfloat16,
                     fuse: bool = True) -> TransformerLM:
    """A `TransformerLM` on a GGUF file's own quantized weights (Q4_1 linears, Q8_0 table).

    stored: the file's tensors as `load_gguf_tensors` returns them ({"qtypes", "data"}). dtype: the
    activations and norms (bf16 by default: what the packed kernels take). fuse: q/k/v and w1/w3 as one
    matmul each (their blocks concatenated by rows, still exact).
    """
    qtypes, data = stored["qtypes"], stored["data"]
    by_key = {key: name for name, key in gguf_names(qtypes, config).items()}
    check_stored_finite(qtypes, data, "the stored tensors")   # `load_gguf_tensors` names the file

    def blocks(*keys: str) -> GGUFBlocks:
        return _stacked_blocks(data, qtypes, [by_key[k] for k in keys])

    with uninitialized():   # every weight is replaced below: no random init (nor the compiler it would import)
        model = TransformerLM(config, device="meta", dtype=dtype)
        if fuse:
            model.fuse_projections()
    with collect_fallbacks():   # announced once for the whole model by set_quantized_kernel
        table = exact_linear(blocks("token_embeddings.weight"), device)
        model.token_embeddings = QuantizedEmbedding(table, dtype=dtype)
        head = table if config.tie_embeddings else exact_linear(blocks("lm_head.weight"), device)
        model.lm_head = RescoredHead(head)    # the bf16 kernel ranks the vocabulary, fp32 picks among the top
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear):
                keys = _linear_parts(model, name)
                _set(model, name, exact_linear(blocks(*keys), device))
    for name, _ in list(model.named_parameters()):           # the norms (F32 in the file)
        module_name, _, attr = name.rpartition(".")
        weight = data[by_key[name]].to(device=device, dtype=dtype)
        setattr(model.get_submodule(module_name), attr, nn.Parameter(weight, requires_grad=False))
    model.rope = RotaryEmbedding(model.rope_dim, config.context_length, config.rope_theta, device=device)
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"no stored tensor for {left[:4]}")
    model.quantization = dict(method=WEIGHTS_NAME, bits=4, group_size=32, lm_head="Q8_0: grouped int8, top rescored",
                              embedding="Q8_0: row lookup")
    return set_quantized_kernel(model.eval(), "auto")


register_weights(WEIGHTS_NAME, gguf_exact_model)
