"""`BPETokenizer`: a real model's byte-level BPE (GPT-2 style), built offline from its vocabulary
and merges, with the same `encode`/`decode` interface as `ByteTokenizer`.

Byte-level BPE (Sennrich et al. 2016; Radford et al. 2019, GPT-2): a regex first cuts the text into
pre-tokens (a word with its leading space, a run of punctuation, whitespace; SmolLM2 also isolates
every digit), each pre-token's UTF-8 bytes become symbols, and the learned merges are applied in the
order they were learned. Vocabularies write bytes in GPT-2's printable alphabet (`bytes_to_unicode`:
a space is "Ġ"). The work is done by Hugging Face `tokenizers` (Rust, the same library the model's
authors use); special tokens such as <|im_start|> are matched whole in the text, as in `ByteTokenizer`.

A student's own assignment-1 BPE tokenizer can stand in: `cs336_vocab_and_merges()` returns the
vocabulary as {id: bytes} and the merges as [(bytes, bytes)], the assignment's format (its
pre-tokenizer regex does not split digits, so ids differ on numbers).
"""

from __future__ import annotations

import functools

import torch

from .. import _checks

# llama.cpp's pre-tokenizers (`tokenizer.ggml.pre`) that we know how to reproduce: name -> digits
# isolated one by one before the GPT-2 regex runs (llama.cpp: the "\p{N}" rule of smollm/starcoder).
PRE_TOKENIZERS = {"smollm": True, "starcoder": True, "gpt2": False, "gpt-2": False}


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table: printable Latin-1 bytes stand for
    themselves, the other 68 (controls, space, ...) are shifted to code points 256, 257, ..."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shift = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return table


class BPETokenizer:
    """Byte-level BPE over `tokens` (GPT-2 alphabet) and `merges` ("left right" strings, in order).

    special: ids of tokens matched whole in text and never merged (control tokens); eos_id ends an
    answer; chat_template: the model's Jinja template (`apply_chat_template`).
    """

    def __init__(self, tokens: list[str], merges: list[str], special: list[int], pre: str = "gpt2",
                 bos_id: int | None = None, eos_id: int | None = None, chat_template: str | None = None):
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        if pre not in PRE_TOKENIZERS:
            raise ValueError(f"pre-tokenizer {pre!r} is not supported; known: {sorted(PRE_TOKENIZERS)}")
        if len(set(tokens)) != len(tokens):
            raise ValueError("tokens must be distinct strings")
        self.tokens = list(tokens)
        self.pre = pre
        self.chat_template = chat_template
        self.bos_id, self.eos_id = bos_id, eos_id
        vocab = {t: i for i, t in enumerate(self.tokens)}
        pairs = [tuple(m.split(" ")) for m in merges]
        if any(len(p) != 2 for p in pairs):
            raise ValueError("each merge must be two symbols separated by one space")
        self.merges = pairs
        self._tok = Tokenizer(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if PRE_TOKENIZERS[pre]:
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        self._tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        self._tok.decoder = decoders.ByteLevel()
        self.special_tokens = [self.tokens[i] for i in special]
        self._tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in self.special_tokens])
        self.special_to_id = {t: vocab[t] for t in self.special_tokens}
        self.id_to_special = {i: t for t, i in self.special_to_id.items()}

    @classmethod
    def from_spec(cls, spec: dict) -> "BPETokenizer":
        """From `gguf.gguf_tokenizer_spec` output (or the JSON it was cached as). A spec with a missing or
        mistyped field is refused (ValueError naming the field), never half-read."""
        if not isinstance(spec, dict):
            raise ValueError(f"a tokenizer spec must be a dict (JSON object), got {type(spec).__name__}")
        for field, kind, what in (("tokens", str, "strings"), ("merges", str, "strings"), ("special", int, "ints")):
            value = spec.get(field)
            if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, kind) for v in value):
                raise ValueError(f"tokenizer spec field {field!r} must be a list of {what}, got "
                                 f"{'nothing (missing)' if value is None else type(value).__name__}; fields present: "
                                 f"{sorted(spec)}")
        bad = [i for i in spec["special"] if not 0 <= i < len(spec["tokens"])]
        if bad:
            raise ValueError(f"tokenizer spec field 'special' names ids outside its {len(spec['tokens'])} tokens: "
                             f"{bad}")
        return cls(spec["tokens"], spec["merges"], spec["special"], spec.get("pre", "gpt2"), spec.get("bos_id"),
                   spec.get("eos_id"), spec.get("chat_template"))

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def stop_ids(self) -> list[int]:
        """Tokens that end a generated answer: eos (<|im_end|> for chat models) and <|endoftext|>."""
        ids = [self.eos_id] if self.eos_id is not None else []
        return ids + [i for t, i in self.special_to_id.items() if t == "<|endoftext|>" and i not in ids]

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        # encode_batch lets go of the GIL while the Rust tokenizer works (encode holds it): a server that
        # tokenizes a long prompt on a worker thread keeps its event loop answering meanwhile
        return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids) -> str:
        """Token ids -> text; special tokens appear as their text; a split UTF-8 character becomes U+FFFD."""
        if hasattr(ids, "tolist") and not isinstance(ids, torch.Tensor):   # a numpy array: its Python values
            ids = ids.tolist()
        ids = _checks.token_id_list("ids", ids)   # refuses 65.7 (int() would make it 65, another token) and True
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside this tokenizer's vocabulary [0, {self.vocab_size})")
        return self._tok.decode(ids, skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as the model was trained to see it (its own Jinja template), ending with
        the assistant's header when add_generation_prompt. messages: [{"role": ..., "content": ...}]."""
        if not isinstance(add_generation_prompt, bool):
            raise TypeError(f"add_generation_prompt must be True or False, got {add_generation_prompt!r}")
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise TypeError(f"messages[{i}] must be a dict with str 'role' and 'content', got {m!r}")
        return _compiled_template(self.chat_template).render(messages=list(messages),
                                                             add_generation_prompt=add_generation_prompt)

    def cs336_vocab_and_merges(self) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
        """The vocabulary {id: bytes} and merges [(bytes, bytes)] in CS336 assignment 1's format."""
        decode = {c: b for b, c in bytes_to_unicode().items()}

        def to_bytes(s: str) -> bytes:
            return bytes(decode[c] for c in s)

        vocab = {i: (t.encode("utf-8") if i in self.id_to_special else to_bytes(t)) for i, t in enumerate(self.tokens)}
        return vocab, [(to_bytes(a), to_bytes(b)) for a, b in self.merges]


@functools.lru_cache(maxsize=4)
def _compiled_template(source: str):
    """Jinja in a sandbox (a template is data from a file, it must not reach Python internals)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(source)
