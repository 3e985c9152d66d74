"""Reading a llama.cpp GGUF file: the model's sizes, its weights in the CS336 layout, its tokenizer.

GGUF is llama.cpp's one-file format: a header of typed key/value metadata (architecture sizes, the
tokenizer's vocabulary and merges, the chat template) followed by the tensors, usually quantized in
blocks of 32 weights (Q4_1: 4-bit codes q with an fp16 scale d and minimum m per block, w = d q + m;
Q8_0: 8-bit codes with an fp16 scale). We read it with `gguf`, llama.cpp's own pure-Python reader,
and dequantize with `gguf.quants.dequantize`.

Llama checkpoints converted to GGUF have the rows of their Q and K projections permuted for
llama.cpp's "normal" RoPE, which rotates adjacent pairs (x[2k], x[2k+1]): the CS336 assignment-1
convention. So the tensors map onto our state-dict keys as they are (a Hugging Face checkpoint, which
rotates halves, would need its rows un-permuted first).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import ModelConfig

SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor name (block i) -> CS336 state-dict key (layer i).
LAYER_TENSORS = {
    "attn_q": "attn.q_proj.weight", "attn_k": "attn.k_proj.weight", "attn_v": "attn.v_proj.weight",
    "attn_output": "attn.output_proj.weight", "attn_norm": "ln1.weight", "ffn_norm": "ln2.weight",
    "ffn_gate": "ffn.w1.weight", "ffn_down": "ffn.w2.weight", "ffn_up": "ffn.w3.weight",
}
GLOBAL_TENSORS = {"token_embd.weight": "token_embeddings.weight", "output_norm.weight": "ln_final.weight",
                  "output.weight": "lm_head.weight"}  # no output.weight: the embedding table is tied


@dataclass
class GGUFFile:
    """A parsed GGUF file: its header metadata and its (still quantized, memory-mapped) tensors."""

    path: Path
    metadata: dict[str, object]   # header key -> value (arrays as lists, strings as str)
    tensors: dict                 # tensor name -> gguf.ReaderTensor (name, tensor_type, shape, data)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture"))


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse the header and tensor table of `path`; a file that is not valid GGUF is a ValueError."""
    try:
        import gguf
    except ImportError as e:  # a declared dependency; only a broken install gets here
        raise ImportError("reading GGUF files needs the `gguf` package: pip install gguf") from e
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        reader = gguf.GGUFReader(path)
        metadata = {name: field.contents() for name, field in reader.fields.items()}
        tensors = {t.name: t for t in reader.tensors}
    except Exception as e:  # the reader fails in many ways on a damaged file (struct, numpy, ValueError)
        raise ValueError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e}); "
                         f"reinstall the package that ships it") from e
    return GGUFFile(path, metadata, tensors)


def gguf_config(gf: GGUFFile) -> ModelConfig:
    """The `ModelConfig` of a llama-architecture GGUF (refusing what `TransformerLM` cannot run)."""
    arch = gf.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"{gf.path.name}: architecture {arch!r} is not supported; "
                         f"supported: {SUPPORTED_ARCHITECTURES}")
    meta = gf.metadata
    required = [f"{arch}.{k}" for k in ("block_count", "context_length", "embedding_length", "feed_forward_length",
                                        "attention.head_count")]
    missing = [k for k in required if k not in meta]
    if missing:
        raise ValueError(f"{gf.path.name}: header lacks {missing}")
    unsupported = [k for k in (f"{arch}.expert_count", f"{arch}.rope.scaling.type")
                   if meta.get(k) not in (None, 0, "none")]
    if unsupported:
        raise ValueError(f"{gf.path.name}: {unsupported} are set (mixture of experts / RoPE scaling); "
                         f"TransformerLM implements neither")
    num_heads = int(meta[f"{arch}.attention.head_count"])
    d_model = int(meta[f"{arch}.embedding_length"])
    if "token_embd.weight" not in gf.tensors:
        raise ValueError(f"{gf.path.name}: no token_embd.weight tensor")
    vocab = gf.tensors["token_embd.weight"].shape[-1]  # GGUF lists dims fastest-first: (D, V)
    config = ModelConfig(
        vocab_size=int(vocab), context_length=int(meta[f"{arch}.context_length"]), d_model=d_model,
        num_layers=int(meta[f"{arch}.block_count"]), num_heads=num_heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", num_heads)),
        d_ff=int(meta[f"{arch}.feed_forward_length"]),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in gf.tensors)
    rope_dims = meta.get(f"{arch}.rope.dimension_count", config.head_dim)
    if rope_dims != config.head_dim:
        raise ValueError(f"{gf.path.name}: RoPE on {rope_dims} of {config.head_dim} head dims (partial rotary) "
                         f"is not supported")
    return config


def gguf_names(tensors, config: ModelConfig, label: str = "GGUF file") -> dict[str, str]:
    """GGUF tensor name -> CS336 state-dict key for every name in `tensors`, refusing a set that does not
    match `config`'s layers (tied models have no output.weight)."""
    names = dict(GLOBAL_TENSORS)
    for i in range(config.num_layers):
        names.update({f"blk.{i}.{g}.weight": f"layers.{i}.{c}" for g, c in LAYER_TENSORS.items()})
    unknown = sorted(set(tensors) - set(names))
    missing = sorted(k for k, v in names.items() if k not in tensors and v != "lm_head.weight")
    if unknown or missing:
        raise ValueError(f"{label}: tensors do not match a {config.num_layers}-layer llama model "
                         f"(missing {missing[:6]}, unexpected {unknown[:6]})")
    return {k: v for k, v in names.items() if k in tensors}


def gguf_state_dict(gf: GGUFFile, config: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to fp32 under its CS336 key (tied models have no lm_head.weight).

    Shapes are checked against `config` (default: `gguf_config(gf)`) before anything is returned.
    """
    from gguf.quants import dequantize

    config = gguf_config(gf) if config is None else config
    names = gguf_names(gf.tensors, config, gf.path.name)
    expected = _expected_shapes(config)
    state = {}
    for gguf_name, tensor in gf.tensors.items():
        key = names[gguf_name]
        try:
            with np.errstate(invalid="ignore", over="ignore"):   # a NaN/Inf is refused below, by name
                array = dequantize(tensor.data, tensor.tensor_type)
        except Exception as e:
            raise ValueError(f"{gf.path.name}: cannot dequantize {gguf_name} ({tensor.tensor_type!r}): {e}") from e
        if tuple(array.shape) != expected[key]:
            raise ValueError(f"{gf.path.name}: {gguf_name} has shape {tuple(array.shape)}, the config implies "
                             f"{expected[key]} for {key}")
        state[key] = torch.from_numpy(np.array(array, dtype=np.float32))  # a writable copy (the file is mmap'd)
    bad = [f"{name} ({key})" for name, key in names.items() if not torch.isfinite(state[key]).all()]
    if bad:
        raise ValueError(f"{gf.path}: NaN/Inf in tensor {', '.join(bad[:4])} (a damaged or edited file)")
    return state


def check_stored_finite(qtypes: dict[str, str], data: dict, label: str) -> None:
    """Refuse stored tensors (`load_gguf_tensors`'s {"qtypes", "data"}) holding NaN/Inf, naming the tensor and
    `label` (the file): float tensors (F32/F16) value by value, Q4_1/Q8_0 blocks by their fp16 scales and
    minima (their int codes cannot be non-finite). Run once at load: a NaN norm weight or block scale would
    otherwise turn every logit into NaN without an error."""
    for name, qtype in qtypes.items():
        if qtype in ("F32", "F16"):
            parts = {"values": torch.as_tensor(data[name])}
        elif qtype in BLOCK_BYTES:
            blocks = torch.as_tensor(_block_bytes(data[name], qtype, name))   # (O, G, bytes per block), no copy
            # an fp16 is NaN/Inf iff its 5 exponent bits are all 1: bits 2-6 of its high (second) byte
            parts = {what: (blocks[..., hi] & 0x7C) != 0x7C
                     for what, hi in (("block scales", 1), ("block minima", 3))[:2 if qtype == "Q4_1" else 1]}
        else:
            continue
        for what, values in parts.items():
            bad = ~values if values.dtype == torch.bool else ~torch.isfinite(values)
            if bool(bad.any()):
                raise ValueError(f"{label}: tensor {name} ({qtype}) has {int(bad.sum())} NaN/Inf {what} (a damaged "
                                 f"or edited file: was its type field or its data changed?)")


# Bytes of one block of 32 weights: (scale, minimum, codes) fp16, fp16, 16 bytes of nibbles / fp16, 32 int8
BLOCK_BYTES = {"Q4_1": 20, "Q8_0": 34}


@dataclass
class GGUFBlocks:
    """One quantized GGUF matrix as stored, not dequantized: w = codes * scale (+ minimum), blocks of 32."""

    qtype: str                       # "Q4_1" (codes in [0, 15]) or "Q8_0" (codes in [-128, 127])
    codes: torch.Tensor              # (O, I) uint8 / int8
    scale: torch.Tensor              # (O, I / 32) fp16: d
    minimum: torch.Tensor | None     # (O, I / 32) fp16: m (Q4_1), None (Q8_0)


def gguf_blocks(raw, qtype: str, name: str = "tensor") -> GGUFBlocks:
    """The blocks of a stored tensor, its bytes `raw` (O, bytes per row) uint8, read as `qtype` (Q4_1 or
    Q8_0). Q4_1 packs element j of a block in the low nibble of byte j and element j + 16 in its high
    nibble, after the fp16 scale d and minimum m; Q8_0 holds d, then 32 int8 codes."""
    blocks = _block_bytes(raw, qtype, name)                                  # (O, G, bytes per block)
    rows = blocks.shape[0]
    scale, minimum = _block_halves(raw, qtype, name)
    if qtype == "Q8_0":
        codes = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, -1)
        return GGUFBlocks(qtype, torch.from_numpy(codes.copy()), scale, None)
    nibbles = blocks[..., 4:]                                               # (O, G, 16)
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(rows, -1)
    return GGUFBlocks(qtype, torch.from_numpy(codes), scale, minimum)


def _block_bytes(raw, qtype: str, name: str) -> np.ndarray:
    """The stored bytes (O, bytes per row) as (O, G, bytes per block), refusing what is not whole blocks."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"{name} is {qtype}; only {sorted(BLOCK_BYTES)} blocks are read as stored")
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] % BLOCK_BYTES[qtype]:
        raise ValueError(f"{name} holds {raw.shape} bytes, not whole {qtype} blocks per row")
    return raw.reshape(raw.shape[0], -1, BLOCK_BYTES[qtype])


def _block_halves(raw, qtype: str, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fp16 scale d (O, G) and, for Q4_1, minimum m (O, G) of every block, without unpacking the codes."""
    blocks = _block_bytes(raw, qtype, name)

    def half(lo: int) -> torch.Tensor:                                      # (O, G) fp16 from 2 bytes
        return torch.from_numpy(np.ascontiguousarray(blocks[..., lo:lo + 2]).view(np.float16)[..., 0].copy())

    return half(0), (half(2) if qtype == "Q4_1" else None)


def _expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    D, F, H = c.d_model, c.d_ff, c.head_dim
    shapes = {"token_embeddings.weight": (c.vocab_size, D), "ln_final.weight": (D,),
              "lm_head.weight": (c.vocab_size, D)}
    per_layer = {"attn.q_proj.weight": (c.num_heads * H, D), "attn.k_proj.weight": (c.num_kv_heads * H, D),
                 "attn.v_proj.weight": (c.num_kv_heads * H, D), "attn.output_proj.weight": (D, c.num_heads * H),
                 "ln1.weight": (D,), "ln2.weight": (D,), "ffn.w1.weight": (F, D), "ffn.w2.weight": (D, F),
                 "ffn.w3.weight": (F, D)}
    for i in range(c.num_layers):
        shapes.update({f"layers.{i}.{k}": v for k, v in per_layer.items()})
    return shapes


def gguf_tokenizer_spec(gf: GGUFFile) -> dict:
    """What a byte-level BPE tokenizer needs from the header (plain JSON-able values).

    tokens: the vocabulary in GPT-2's byte-to-unicode alphabet ("Ġ" is a space); merges: "left right"
    in learned order; special: ids of control tokens (type 3) such as <|im_start|>; pre: llama.cpp's
    pre-tokenizer name; chat_template: the Jinja template text.
    """
    meta = gf.metadata
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"{gf.path.name}: tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    return dict(tokens=tokens, merges=list(meta["tokenizer.ggml.merges"]),
                special=[i for i, t in enumerate(types) if t == 3],
                pre=meta.get("tokenizer.ggml.pre", "gpt2"),
                bos_id=meta.get("tokenizer.ggml.bos_token_id"), eos_id=meta.get("tokenizer.ggml.eos_token_id"),
                chat_template=meta.get("tokenizer.chat_template"))


def gguf_round_trip(weight: torch.Tensor, qtype: str = "Q4_1") -> torch.Tensor:
    """`weight` (..., I) through llama.cpp's own quantizer and back (`gguf.quants`, blocks of 32 along I):
    what storing it as a GGUF `qtype` ("Q4_1", "Q8_0", ...) would keep. A weight already on that grid
    comes back bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    kind = getattr(GGMLQuantizationType, qtype, None)
    if kind is None:
        raise ValueError(f"unknown GGUF quantization type {qtype!r} (e.g. 'Q4_1', 'Q8_0')")
    if weight.shape[-1] % 32:
        raise ValueError(f"GGUF blocks hold 32 values: the last dim must be a multiple of 32, "
                         f"got {tuple(weight.shape)}")
    array = weight.detach().float().cpu().numpy()
    back = dequantize(quantize(array, kind), kind)
    return torch.from_numpy(np.array(back, dtype=np.float32)).to(weight.device, weight.dtype)
