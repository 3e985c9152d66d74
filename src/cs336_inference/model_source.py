"""What `--model` names for chat, generate and serve: a model by name, or a checkpoint file, and its tokenizer.

A name is a toy model shipped in the package or a real one read from its installed package (`load_pretrained`).
A file is either
  - one of this project's checkpoints (`checkpoints.save` writes them, and so does `train --out`): it carries
    its config, so it needs nothing else; or
  - a CS336 assignment-1 checkpoint (a state dict, or a dict holding one under "model", ...): its config comes
    from a JSON file (`--config`) and/or flags, and its keys are placed by `key_map="auto"`
    (`load_cs336_checkpoint`), which prints the mapping it found (to stderr here: stdout is the answer).
A file's tokenizer: `--tokenizer` ("byte", a model name whose tokenizer to use, or a Hugging Face
`tokenizer.json` file, with the chat template from a `tokenizer_config.json` beside it), else the name a
checkpoint stores under extra["tokenizer"], else the byte tokenizer when the vocabulary is the byte
tokenizer's (the toy models'); anything else must be named.

`resolve` reads only what is cheap (a file's header and config, memory-mapped; a tokenizer), so a command
can refuse a model (no chat template, a tokenizer that does not fit) before any weights load; `ModelSource.load`
builds the model.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass, fields
from pathlib import Path

# the fields an assignment-1 model needs (rope_theta has the handout's default, 10000)
CS336_FIELDS = ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff")
# tokens that end an answer, where a tokenizer.json file has them
_STOP_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "</s>")


@dataclass
class ModelSource:
    """A model to load: `name` (what the banner says), `path` (None for a named model), its `tokenizer`,
    and for a file its `config` and what `torch.load` read (`blob`, memory-mapped)."""

    name: str
    tokenizer: object
    path: Path | None = None
    config: object = None
    blob: object = None
    own_format: bool = False     # a file `checkpoints.save` wrote (else an assignment-1 checkpoint)

    @property
    def is_real(self) -> bool:
        """A real pretrained model (by name): large work, with published GGUF blocks."""
        from .model import REAL_MODELS

        return self.path is None and self.name in REAL_MODELS

    def load(self, device=None, dtype=None):
        """The model (a `TransformerLM`), its weights cast to `dtype` (default fp32) on `device`."""
        from .model import load_pretrained
        from .model.checkpoints import load_cs336_checkpoint

        if self.path is None:
            return load_pretrained(self.name, device=device, dtype=dtype)
        if self.own_format:
            return load_cs336_checkpoint(self.blob["model"], self.config, device=device, dtype=dtype)
        try:
            with contextlib.redirect_stdout(sys.stderr):   # key_map="auto" prints the mapping it found
                return load_cs336_checkpoint(self.blob, self.config, device=device, dtype=dtype, key_map="auto")
        except ValueError as err:   # name the config it was given first: that is what a user fixes
            c = self.config
            given = ", ".join(f"{k}={getattr(c, k)}" for k in (*CS336_FIELDS[:5], "num_kv_heads", "d_ff"))
            raise ValueError(f"{self.path} does not match the config given ({given}): {err}") from None


def is_path(model: str) -> bool:
    """Whether `--model` names a file rather than a model: it is not a known name, and it has a folder
    separator, a checkpoint suffix, or names an existing file."""
    from .model import REAL_MODELS, available_pretrained

    if model in REAL_MODELS or model in available_pretrained():
        return False
    return os.sep in model or "/" in model or model.endswith((".pt", ".pth", ".ckpt", ".bin")) or Path(model).exists()


def resolve(model: str, tokenizer: str | None = None, config: dict | None = None) -> ModelSource:
    """The `ModelSource` that `model` (a name or a checkpoint file) names.

    tokenizer: for a file, "byte", a model name, or a tokenizer.json file (see the module docstring).
    config: for an assignment-1 file, the ModelConfig fields (from `--config` and flags; rope_theta
    defaults to 10000). Both are refused for a named model, which has its own."""
    from .model import REAL_MODELS, available_pretrained, load_tokenizer

    if not is_path(model):
        if tokenizer is not None or config:
            given = "--tokenizer" if tokenizer is not None else "--config / the config flags"
            raise ValueError(f"{given} applies to a checkpoint file; {model!r} is a named model with its own")
        if model not in REAL_MODELS and model not in available_pretrained():
            raise ValueError(f"unknown pretrained model {model!r}; shipped models: {available_pretrained()}; real "
                             f"models (from installed packages): {sorted(REAL_MODELS)}; or a checkpoint file "
                             f"(a path, e.g. trained/target.pt)")
        return ModelSource(model, load_tokenizer(model))
    path = Path(model)
    blob = _read(path)
    own = _is_own_format(blob)
    if own:
        from .model import ModelConfig

        if config:
            raise ValueError(f"--config / the config flags apply to an assignment-1 checkpoint; {path} was written "
                             f"by this project's save (or train --out) and carries its own config")
        model_config = ModelConfig.from_dict(blob["config"])
        named = blob.get("extra", {}).get("tokenizer") if isinstance(blob.get("extra"), dict) else None
    else:
        model_config = cs336_config(config or {}, path)
        named = None
    return ModelSource(str(path), _file_tokenizer(tokenizer or named, model_config.vocab_size, path), path,
                       model_config, blob, own)


def cs336_config(values: dict, path) -> object:
    """A ModelConfig for an assignment-1 checkpoint from `values` (ModelConfig fields), naming any missing one."""
    from .model import ModelConfig

    missing = [f for f in CS336_FIELDS if values.get(f) is None]
    if missing:
        flags = ", ".join("--" + f.replace("_", "-") for f in missing)
        raise ValueError(f"{path} is an assignment-1 checkpoint (a state dict, no config): give its config as "
                         f"--config CONFIG.json (keys {', '.join(CS336_FIELDS)}) or flags; missing: {flags}")
    known = {f.name for f in fields(ModelConfig)}
    return ModelConfig(**{"rope_theta": 10000.0, **{k: v for k, v in values.items() if k in known and v is not None}})


def read_config_file(path: str) -> dict:
    """The ModelConfig fields in a JSON file (other keys, e.g. a training run's learning rate, are ignored)."""
    from .model import ModelConfig

    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--config: no file at {file}")
    try:
        data = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--config: {file} is not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config: {file} must hold a JSON object of ModelConfig fields, got {type(data).__name__}")
    known = {f.name for f in fields(ModelConfig)}
    return {k: v for k, v in data.items() if k in known}


def _read(path: Path):
    import torch

    if path.is_dir():
        raise ValueError(f"--model {path} is a folder; give the checkpoint file inside it")
    if not path.is_file():
        raise FileNotFoundError(f"--model: no checkpoint file at {path} (nor a model of that name)")
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:   # an old (non-zip) file cannot be memory-mapped: read it whole
            if "mmap" not in str(err):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, EOFError, RuntimeError, ValueError, TypeError, AttributeError, IndexError) as err:
        raise ValueError(f"--model {path} is not a readable PyTorch checkpoint ({type(err).__name__}: "
                         f"{' '.join(str(err).split())[:200]})") from None
    except Exception as err:   # the weights-only unpickler's refusals (pickle.UnpicklingError and others)
        raise ValueError(f"--model {path} is not a readable PyTorch checkpoint of plain tensors "
                         f"({type(err).__name__}: {' '.join(str(err).split())[:200]})") from None


def _is_own_format(blob) -> bool:
    from .model.checkpoints import FORMAT

    return isinstance(blob, dict) and blob.get("format") == FORMAT and "config" in blob and "model" in blob


def _file_tokenizer(spec: str | None, vocab_size: int, path: Path):
    """The tokenizer `spec` names ("byte", a model name or a tokenizer.json file), or the byte tokenizer when
    the model's vocabulary is exactly the byte tokenizer's; refused when it has more tokens than the model."""
    from .model import REAL_MODELS, ByteTokenizer, available_pretrained, load_tokenizer

    if spec is None:
        if vocab_size != ByteTokenizer().vocab_size:
            raise ValueError(f"{path} does not name its tokenizer and its vocabulary ({vocab_size} tokens) is not the "
                             f"byte tokenizer's ({ByteTokenizer().vocab_size}): pass --tokenizer (a tokenizer.json "
                             f"file, or a model name such as smollm2-135m)")
        spec = "byte"
    if spec == "byte":
        tokenizer = ByteTokenizer()
    elif spec in REAL_MODELS or spec in available_pretrained():
        tokenizer = load_tokenizer(spec)
    elif Path(spec).is_file():
        tokenizer = TokenizerFile(spec)
    else:
        raise ValueError(f"--tokenizer must be 'byte', a model name ({', '.join(sorted(REAL_MODELS))}, ...) or a "
                         f"tokenizer.json file; got {spec!r} (no such file)")
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"the tokenizer {spec!r} has {tokenizer.vocab_size} tokens but {path} embeds {vocab_size}: "
                         f"not the tokenizer it was trained with (pass --tokenizer)")
    return tokenizer


class TokenizerFile:
    """A Hugging Face `tokenizer.json` file (the `tokenizers` library) with our encode/decode; its end
    tokens (<|endoftext|>, <|im_end|>, </s>, ...) stop an answer. A `tokenizer_config.json` beside it (as
    Hugging Face saves them) may give the chat template (its "chat_template") and the end token ("eos_token")."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as err:   # the Rust library's parse errors
            raise ValueError(f"--tokenizer {path} is not a readable tokenizer.json file ({err})") from None
        self.name = str(path)
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.stop_ids = [vocab[t] for t in _STOP_TOKENS if t in vocab]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        settings = _tokenizer_config(Path(path).with_name("tokenizer_config.json"))
        self.chat_template = settings.get("chat_template") if isinstance(settings.get("chat_template"), str) else None
        self.special = {k: _token_text(settings.get(k)) for k in ("bos_token", "eos_token")}
        if self.special["eos_token"] in vocab and vocab[self.special["eos_token"]] not in self.stop_ids:
            self.stop_ids.insert(0, vocab[self.special["eos_token"]])

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation in the template's format (rendered as `BPETokenizer.apply_chat_template` does)."""
        from .model.bpe_tokenizer import _compiled_template

        if self.chat_template is None:
            raise ValueError(f"{self.name} has no chat template (no tokenizer_config.json beside it holds one)")
        return _compiled_template(self.chat_template).render(messages=list(messages),
                                                             add_generation_prompt=add_generation_prompt,
                                                             **{k: v or "" for k, v in self.special.items()})

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _tokenizer_config(path: Path) -> dict:
    """The settings in a Hugging Face tokenizer_config.json ({} when there is none); a broken one is refused."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"--tokenizer: {path} is not a readable JSON file ({err})") from None
    return data if isinstance(data, dict) else {}


def _token_text(value) -> str | None:
    """A token as tokenizer_config.json writes it: a str, or {"content": str, ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
