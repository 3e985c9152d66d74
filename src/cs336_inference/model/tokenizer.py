"""`ByteTokenizer`: UTF-8 bytes are token ids 0..255; special tokens follow from 256.

Byte-level models need no trained vocabulary, which keeps the shipped models self-contained.
`load_tokenizer(name)` gives any model's tokenizer by name: the `ByteTokenizer` of the shipped toy
models, or a real model's own BPE (`bpe_tokenizer.BPETokenizer`, same encode/decode interface).
"""

from __future__ import annotations

import re


from .. import _checks

ENDOFTEXT = "<|endoftext|>"


class ByteTokenizer:
    def __init__(self, special_tokens: tuple[str, ...] | list[str] = (ENDOFTEXT,)):
        if isinstance(special_tokens, (str, bytes)) or not isinstance(special_tokens, (list, tuple)):
            raise TypeError(f"special_tokens must be a list or tuple of strings (e.g. [{ENDOFTEXT!r}]), got "
                            f"{type(special_tokens).__name__} {special_tokens!r}")
        special_tokens = list(special_tokens)
        for s in special_tokens:
            _checks.instance("special_tokens[i]", s, str, "a str")
        if len(set(special_tokens)) != len(special_tokens) or any(not s for s in special_tokens):
            raise ValueError(f"special_tokens must be distinct non-empty strings, got {special_tokens}")
        self.special_tokens = special_tokens
        self.special_to_id = {s: 256 + i for i, s in enumerate(special_tokens)}
        self.id_to_special = {i: s for s, i in self.special_to_id.items()}
        # Longest first so a special token that contains another is matched whole.
        ordered = sorted(special_tokens, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, ordered)) + ")") if ordered else None

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.special_tokens)

    @property
    def stop_ids(self) -> list[int]:
        """Tokens that end a generated text (here <|endoftext|>, if this tokenizer has it)."""
        return [self.special_to_id[ENDOFTEXT]] if ENDOFTEXT in self.special_to_id else []

    @property
    def eot_id(self) -> int:
        if ENDOFTEXT not in self.special_to_id:
            raise ValueError(f"this tokenizer has no {ENDOFTEXT} token")
        return self.special_to_id[ENDOFTEXT]

    def encode(self, text: str) -> list[int]:
        _checks.instance("text", text, str, "a str")
        pieces = self._split.split(text) if self._split else [text]
        ids: list[int] = []
        for piece in pieces:
            if piece in self.special_to_id:
                ids.append(self.special_to_id[piece])
            else:
                try:
                    ids.extend(piece.encode("utf-8"))
                except UnicodeEncodeError as err:   # a lone surrogate: bytes that were not UTF-8 upstream
                    raise ValueError(f"text is not valid Unicode: {text[err.start:err.end]!r} at position "
                                     f"{err.start} (a lone surrogate, e.g. from input that was not UTF-8)") from None
        return ids

    def decode(self, ids) -> str:
        """Bytes are joined and decoded as UTF-8 (invalid sequences become U+FFFD)."""
        out, buffer = [], bytearray()
        for i in _checks.token_id_list("ids", ids):
            if 0 <= i < 256:
                buffer.append(i)
            elif i in self.id_to_special:
                out.append(buffer.decode("utf-8", errors="replace"))
                buffer = bytearray()
                out.append(self.id_to_special[i])
            else:
                raise ValueError(f"token id {i} is outside this tokenizer's vocabulary [0, {self.vocab_size})")
        out.append(buffer.decode("utf-8", errors="replace"))
        return "".join(out)


def load_tokenizer(name: str):
    """The tokenizer of model `name`: a `ByteTokenizer` for the shipped toy models, the model's own
    byte-level BPE for a real one ("smollm2-135m"; read offline from its installed package)."""
    from .checkpoints import available_pretrained
    from .real_models import REAL_MODELS, load_real_tokenizer

    if name in REAL_MODELS:
        return load_real_tokenizer(name)
    if name.startswith("mqar-") and name in available_pretrained():
        raise ValueError(f"{name!r} reads multi-query associative recall token ids, not text: it has no "
                         f"tokenizer (make its inputs with cs336_inference.data.mqar.MQARTask)")
    if name in available_pretrained():
        return ByteTokenizer()
    raise ValueError(f"unknown model {name!r}; shipped: {available_pretrained()}, real: {sorted(REAL_MODELS)}")
