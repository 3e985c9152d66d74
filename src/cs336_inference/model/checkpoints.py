"""Saving and loading models: our own (config + weights) files, shipped models, the real pretrained
model (`real_models`: SmolLM2-135M from an installed package), and a student's CS336 assignment-1
checkpoint.

Every loader checks keys and shapes *before* touching the model and names what is wrong, so a
mismatched file never half-loads.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from pathlib import Path

import torch

from .. import _checks
from .checkpoint_hints import ablation_hints, diagnose
from .checkpoint_keys import apply_key_map
from .config import ModelConfig
from .key_inference import AutoKeyMapError, infer_key_map
from .layers import RotaryEmbedding
from .real_models import REAL_MODELS, WEIGHT_FORMATS, load_real_tensors, load_real_weights
from .transformer import TransformerLM
from .verify import verify_checkpoint

FORMAT = "cs336-inference/v1"
ASSETS = Path(__file__).resolve().parents[1] / "assets"
_STATE_KEYS = ("model", "model_state_dict", "state_dict", "model_state")


def save(path: str | os.PathLike, model: TransformerLM, extra: dict | None = None,
         dtype: torch.dtype | None = None) -> None:
    """Write {format, config, model (state dict), extra} to `path`; `dtype` (e.g. bf16) shrinks the file.

    Atomic: the file is written under a temporary name in the same folder and renamed over `path`
    only once complete, so a failed save leaves the previous file as it was. `extra` must be plain
    data (dicts, lists, str, numbers, tensors): `load` reads files with `weights_only=True`.
    """
    _checks.instance("model", model, TransformerLM, "a TransformerLM")
    _checks.instance("path", path, (str, os.PathLike), "a file path (str or os.PathLike)")
    if dtype is not None:
        _checks.instance("dtype", dtype, torch.dtype, "a floating-point torch.dtype or None")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point torch.dtype (e.g. torch.bfloat16) or None, got {dtype}")
    extra = {} if extra is None else _checks.instance("extra", extra, dict, "a dict or None")
    _check_loadable("extra", extra)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().clone()
             for k, v in model.state_dict().items()
             if not (model.config.tie_embeddings and k == "lm_head.weight")}  # a tied table is stored once
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save({"format": FORMAT, "config": model.config.to_dict(), "model": state, "extra": extra}, tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _check_loadable(name: str, obj) -> None:
    """Refuse what `torch.load(weights_only=True)` could not read back (classes, functions, modules, ...)."""
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as e:  # pickling errors and the weights-only unpickler's refusals
        raise ValueError(f"{name} must hold only plain data (dict, list, str, numbers, tensors) so the file "
                         f"loads with weights_only=True; it does not: {e}") from None


def load(path: str | os.PathLike, device=None, dtype: torch.dtype | None = None) -> TransformerLM:
    """Load a file written by `save` (weights cast to `dtype`, default fp32 on CPU)."""
    device = _check_device(device)
    blob = _read(path)
    if not isinstance(blob, dict) or blob.get("format") != FORMAT or "config" not in blob:
        raise ValueError(f"{path} is not a {FORMAT} checkpoint (use load_cs336_checkpoint for an "
                         "assignment-1 state dict)")
    config = ModelConfig.from_dict(blob["config"])
    return load_cs336_checkpoint(blob["model"], config, device=device, dtype=dtype)


def load_extra(path: str | os.PathLike) -> dict:
    """The `extra` dict stored beside the weights (training metadata, recorded metrics)."""
    return _read(path).get("extra", {})


def load_pretrained(name: str, device=None, dtype: torch.dtype | None = None,
                    weights: str = "dequantized") -> TransformerLM:
    """A model by name, offline: a toy model shipped in the package (`available_pretrained()`) or a
    real one read from an installed package ("smollm2-135m", see `real_models`). dtype: default fp32.

    weights (real models): "dequantized" (the published blocks converted to `dtype` once: the
    reference) or "gguf-exact" (the published Q4_1 / Q8_0 blocks themselves on torch's packed kernels,
    no re-quantization; dtype is then the activations', default bf16; see `quantization.gguf_exact`).
    """
    _checks.instance("name", name, str, "a model name (str), e.g. 'target' or 'smollm2-135m'")
    device = _check_device(device)
    _checks.instance("weights", weights, str, "a str")
    if weights != "dequantized":
        if name not in REAL_MODELS:
            raise ValueError(f"weights={weights!r} applies to the real models {sorted(REAL_MODELS)}; {name!r} is a "
                             f"shipped full-precision model (use the default weights='dequantized')")
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weights {weights!r}; available: {['dequantized', *sorted(WEIGHT_FORMATS)]}")
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(f"dtype must be a floating-point torch.dtype or None, got {dtype!r}")
        config, stored = load_real_tensors(name)
        return WEIGHT_FORMATS[weights](config, stored, device=device, dtype=dtype or torch.bfloat16)
    if name in REAL_MODELS:
        config, state = load_real_weights(name, dtype or torch.float32)
        return from_state_dict(config, state, device, dtype, copy=False)
    names = available_pretrained()
    if name not in names:
        raise ValueError(f"unknown pretrained model {name!r}; shipped models: {names}; real models (from "
                         f"installed packages): {sorted(REAL_MODELS)}")
    return load(ASSETS / f"{name}.pt", device=device, dtype=dtype)


def available_pretrained() -> list[str]:
    """The toy models shipped in the package's assets (the real ones are in `real_models.REAL_MODELS`)."""
    return sorted(p.stem for p in ASSETS.glob("*.pt"))


def extract_state_dict(obj) -> dict[str, torch.Tensor]:
    """The model weights inside a checkpoint dict (any of the usual keys), `_orig_mod.` prefixes removed."""
    if isinstance(obj, dict) and not all(isinstance(v, torch.Tensor) for v in obj.values()):
        for key in _STATE_KEYS:
            if key in obj and isinstance(obj[key], dict):
                obj = obj[key]
                break
        else:
            raise ValueError(f"checkpoint dict has no model weights under any of {_STATE_KEYS}; "
                             f"top-level keys: {sorted(map(str, obj))}")
    if not isinstance(obj, dict):
        raise TypeError(f"expected a state dict (dict of tensors), got {type(obj).__name__}")
    odd = [k for k, v in obj.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if odd:
        raise TypeError(f"a state dict maps str keys to tensors; these entries do not: {odd[:5]} "
                        f"({', '.join(sorted({type(obj[k]).__name__ for k in odd[:5]}))} values)")
    return {k.replace("_orig_mod.", ""): v for k, v in obj.items()}


def check_state_dict(state: dict[str, torch.Tensor], model: TransformerLM) -> None:
    """Raise a ValueError naming every missing key, unexpected key and shape mismatch.

    A tied model (config.tie_embeddings) needs no lm_head.weight; if one is given it must equal the
    embedding table (two different tables cannot be tied without losing one of them)."""
    expected = model.state_dict()
    if model.config.tie_embeddings:
        expected.pop("lm_head.weight")
        if "lm_head.weight" in state and "token_embeddings.weight" in state:
            head, table = state["lm_head.weight"], state["token_embeddings.weight"]
            if head.shape != table.shape or not torch.equal(head, table):
                raise ValueError("config.tie_embeddings is True but the checkpoint's lm_head.weight differs from "
                                 "token_embeddings.weight; load it with tie_embeddings=False")
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    mismatched = sorted(f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(v.shape)}"
                        for k, v in expected.items() if k in state and tuple(state[k].shape) != tuple(v.shape))
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    if mismatched:
        problems.append(f"shape mismatches {mismatched}")
    if problems:
        raise ValueError("checkpoint does not match the config: " + "; ".join(problems))


def load_cs336_checkpoint(path_or_state_dict, config: ModelConfig, device=None, dtype: torch.dtype | None = None,
                          key_map=None, allow_dropped=None, verify=None) -> TransformerLM:
    """Build a `TransformerLM(config)` from a CS336 assignment-1 state dict or checkpoint file.

    Accepts a raw state dict or a dict with the weights under "model"/"model_state_dict"/...
    (an "optimizer" entry is ignored), with or without torch.compile's `_orig_mod.` prefix.
    key_map (see `checkpoint_keys`): regex renames {pattern: replacement}, a callable (state_dict,
    config) -> state_dict, "auto" (infer each tensor's role from its shape and name, and print the mapping
    as a pasteable key_map; `key_inference`), or a list of them, applied first. `COMMON_RENAMES`,
    `split_fused_qkv(...)`, `split_fused_gate_up(...)` cover the layouts seen in students' repositories.
    A checkpoint that still does not match is refused naming every key, with hints naming the fix.
    allow_dropped: tensors that may be discarded (by the key map, or keys the model has no place for): a
    regex, a list of regexes or True; each discarded tensor is named in a warning. Without it nothing is
    dropped. Tensors holding NaN or inf are refused by name.
    verify: your own model (or a callable ids -> logits): `verify_checkpoint` then checks the loaded model
    computes the same logits, and raises naming the likely cause (post-norm, NoPE, QK-norm) when not.
    """
    _checks.instance("config", config, ModelConfig, "a ModelConfig")
    device = _check_device(device)
    allowed = _allow_dropped(allow_dropped)
    if verify is not None and not callable(verify):
        raise TypeError(f"verify must be your own model (or a callable ids -> logits) to compare with, got "
                        f"{type(verify).__name__}")
    obj = path_or_state_dict
    if isinstance(obj, (str, os.PathLike)):
        obj = _read(obj)
    original = extract_state_dict(obj)
    dropped: list[str] = []
    state = apply_key_map(original, _auto_steps(key_map), config, dropped)
    shapes = TransformerLM(config, device="meta")  # shapes only
    expected = shapes.state_dict()
    if config.tie_embeddings:
        expected.pop("lm_head.weight")
    state = _discard_allowed(state, original, dropped, expected, config, allowed, allow_dropped)
    try:
        check_state_dict(state, shapes)
    except ValueError as err:   # name every key (as check_state_dict does) and say what the layout looks like
        hints = diagnose(state, expected, config) + _auto_hint(original, config, key_map)
        raise ValueError("\n".join([str(err), *(f"hint: {h}" for h in hints)])) from None
    _check_finite(state)
    model = from_state_dict(config, state, device, dtype, copy=True)
    if verify is not None:
        verify_checkpoint(model, verify)
    return model


def _discard_allowed(state: dict, original: dict, dropped: list[str], expected: dict, config: ModelConfig,
                     allowed, allow_dropped) -> dict:
    """`state` without the keys the model has no place for that `allowed` lets go, after refusing any tensor
    the key map discarded that it does not allow; every discarded tensor is named in one warning."""
    extra = [k for k in state if k not in expected and allowed(k)]
    refused = [k for k in dropped if not allowed(k)]
    if refused:
        raise ValueError(f"key_map discarded {len(refused)} tensor(s) {refused[:8]}; dropping weights changes the "
                         f"model, so it needs allow_dropped= (a regex, a list of them, or True), and the loader "
                         f"then warns which were discarded" + "".join(f"\nhint: {h}" for h in ablation_hints(
                             {**state, **{k: original[k] for k in refused if k in original}}, expected, config)))
    if dropped or extra:
        gone = {k: tuple(original[k].shape) if k in original else tuple(state[k].shape) if k in state else ""
                for k in [*dropped, *extra]}
        warnings.warn(f"load_cs336_checkpoint discarded {len(gone)} tensor(s) (allow_dropped={allow_dropped!r}): "
                      + ", ".join(f"{k} {s}" for k, s in gone.items()), UserWarning, stacklevel=3)
        state = {k: v for k, v in state.items() if k not in extra}
    return state


def _auto_steps(key_map):
    """key_map with each "auto" replaced by the inferred map (printed, so it can be pasted back)."""
    steps = key_map if isinstance(key_map, (list, tuple)) else [key_map]

    def auto(state, config):
        inferred = infer_key_map(state, config)
        if not inferred.rules and not inferred.splits:
            print(f"key_map='auto': all {len(inferred.renames)} tensors it placed already have the handout's names")
        else:
            print(f"key_map='auto' placed {len(inferred.renames)} tensors; to pin this mapping, paste it and pass "
                  f"key_map=key_map:\n{inferred.code}")
        return inferred(state, config)
    if key_map is None:
        return None
    return [auto if isinstance(s, str) and s == "auto" else s for s in steps]


def _auto_hint(original: dict, config: ModelConfig, key_map) -> list[str]:
    """What key_map='auto' would do with this checkpoint (tried, not guessed), unless it was just used."""
    if key_map == "auto" or (isinstance(key_map, (list, tuple)) and "auto" in key_map):
        return []
    try:
        state = infer_key_map(original, config)(original, config)
    except AutoKeyMapError as e:
        return [f"key_map='auto' does not load it either: {e}"]
    shapes = TransformerLM(config, device="meta")
    try:
        check_state_dict(state, shapes)
    except ValueError:
        found = ablation_hints(state, shapes.state_dict(), config)
        return [f"key_map='auto' places the tensors it recognises, but then: {h}" for h in found]
    return [f"key_map='auto' loads this checkpoint (it places all {len(original)} tensors and prints the mapping)"]


def _allow_dropped(allow_dropped):
    """allow_dropped -> predicate key -> bool."""
    if allow_dropped is None or allow_dropped is False:
        return lambda key: False
    if allow_dropped is True:
        return lambda key: True
    patterns = [allow_dropped] if isinstance(allow_dropped, str) else allow_dropped
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"allow_dropped must be None, True, a regex str or a list of them, got {allow_dropped!r}")
    try:
        compiled = [re.compile(p) for p in patterns]
    except re.error as e:
        raise ValueError(f"allow_dropped holds an invalid regular expression ({e}): {allow_dropped!r}") from None
    return lambda key: any(p.search(key) for p in compiled)


def _check_finite(state: dict[str, torch.Tensor]) -> None:
    bad = {}
    for key, value in state.items():
        if value.is_floating_point() and value.device.type != "meta":
            finite = torch.isfinite(value)
            if not finite.all():
                nan = int(torch.isnan(value).sum())
                bad[key] = f"{nan} NaN, {int((~finite).sum()) - nan} inf of {value.numel()}"
    if bad:
        raise ValueError(f"{len(bad)} checkpoint tensors hold NaN or inf, so the model's logits would be NaN: "
                         + "; ".join(f"{k} ({v})" for k, v in list(bad.items())[:8])
                         + ". The training run probably diverged: load an earlier checkpoint")


def _check_device(device) -> torch.device | None:
    """None, or a torch.device that exists on this machine (else a ValueError naming `device`)."""
    if device is None:
        return None
    _checks.instance("device", device, (str, torch.device), "a str, torch.device or None")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"device={device!r} is not a device; use 'cpu', 'cuda', 'cuda:0' or 'mps'") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"device={str(device)!r} but no CUDA GPU is available here (torch.cuda.is_available() "
                             f"is False); use device='cpu' or cs336_inference.get_device()")
        if device.index is not None and device.index >= count:
            raise ValueError(f"device={str(device)!r} but this machine has {count} CUDA GPU(s) (cuda:0..cuda:"
                             f"{count - 1})")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device='mps' but MPS is not available here; use device='cpu'")
    elif device.type not in ("cpu", "cuda", "mps", "meta"):
        raise ValueError(f"device={str(device)!r} is not supported; use 'cpu', 'cuda' or 'mps'")
    return device


def from_state_dict(config: ModelConfig, state: dict[str, torch.Tensor], device=None, dtype: torch.dtype | None = None,
                    copy: bool = True) -> TransformerLM:
    """A model whose parameters are `state`'s tensors (cast to dtype, default fp32); copy=False lets
    them alias the given tensors (a memory-mapped cache, or another model's weights: no second copy)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype (e.g. torch.bfloat16) or None, got {dtype!r}")
    device = _check_device(device)
    model = TransformerLM(config, device="meta")  # shapes only: no random init of weights we replace
    check_state_dict(state, model)
    dtype = torch.float32 if dtype is None else dtype
    state = {k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype, copy=copy)
             for k, v in state.items() if not (config.tie_embeddings and k == "lm_head.weight")}
    if config.tie_embeddings:
        state["lm_head.weight"] = state["token_embeddings.weight"]
    model.load_state_dict(state, strict=True, assign=True)  # the tensors become the parameters
    model.tie_weights()
    model.rope = RotaryEmbedding(model.rope_dim, config.context_length, config.rope_theta, device=device)
    return model.eval()


def _read(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file at {path}")
    return torch.load(path, map_location="cpu", weights_only=True)
