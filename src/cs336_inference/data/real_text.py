"""English text for evaluating a real model offline: CPython's own documentation (`pydoc_data.topics`,
the text `help('if')` prints), split into fixed calibration and evaluation documents.

Every Python installation carries it, so nothing is downloaded or committed. Token streams are made
with the model's own tokenizer; `bytes_per_token` lets losses be reported in bits per UTF-8 byte,
which compares models with different tokenizers (and our byte-level toy models) on one scale.
`docstring_paragraphs` adds the prose of the standard library's docstrings, from the same installation.
"""

from __future__ import annotations

import re

import torch

EVAL_EVERY = 4  # topic i (in sorted order) is evaluation text iff i % EVAL_EVERY == EVAL_EVERY - 1


def pydoc_documents(split: str) -> list[str]:
    """The help topics of one split ("calibration" or "eval"), in sorted-name order; the two never overlap."""
    from pydoc_data.topics import topics

    if split not in ("calibration", "eval"):
        raise ValueError(f"split must be 'calibration' or 'eval', got {split!r}")
    names = sorted(topics)
    return [topics[n] for i, n in enumerate(names) if (i % EVAL_EVERY == EVAL_EVERY - 1) == (split == "eval")]


def prose_paragraphs() -> list[str]:
    """Plain-prose paragraphs (350-650 characters, on one line) of the help text, both splits: English
    to rewrite or summarise (no code, lists or markup)."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        for par in topics[name].split("\n\n"):
            if 350 < len(par) < 650 and not par.startswith(" ") and not any(m in par for m in ("::", "*", "`", "\n ")):
                out.append(" ".join(par.split()))
    return out


def docstring_paragraphs() -> list[str]:
    """Plain-prose paragraphs (250-700 characters, on one line) of the docstrings in the standard library's
    top-level modules, sorted and without repeats: more English to rewrite or summarise, none of it
    `prose_paragraphs`'s (a Python installation's own sources, so nothing is downloaded)."""
    import ast
    import sysconfig
    from pathlib import Path

    markup = re.compile(r"[>{}\[\]=`*\\]|::|  ")   # code, doctests, escapes, lists and reST: not plain prose
    seen = set(prose_paragraphs())
    out = set()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8", errors="ignore"))   # this Python's own sources: they parse
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                for par in (ast.get_docstring(node) or "").split("\n\n"):
                    par = " ".join(par.split())
                    if 250 <= len(par) <= 700 and par[-1] in ".)" and not markup.search(par) and par not in seen:
                        out.add(par)
    return sorted(out)


def token_stream(tokenizer, documents: list[str], separator: int | None = None) -> torch.Tensor:
    """The documents' token ids joined into one 1-D stream (separated by `separator`, e.g. end of text)."""
    ids: list[int] = []
    for doc in documents:
        if ids and separator is not None:
            ids.append(separator)
        ids.extend(tokenizer.encode(doc))
    return torch.tensor(ids, dtype=torch.long)


def bytes_per_token(tokenizer) -> torch.Tensor:
    """(V,) UTF-8 bytes each token stands for (a special token counts its own text)."""
    if hasattr(tokenizer, "cs336_vocab_and_merges"):   # a BPE: its vocabulary as bytes
        vocab, _ = tokenizer.cs336_vocab_and_merges()
        return torch.tensor([len(vocab[i]) for i in range(tokenizer.vocab_size)])
    return torch.tensor([1 if i < 256 else len(tokenizer.decode([i]).encode("utf-8"))   # bytes: one each
                         for i in range(tokenizer.vocab_size)])


def eval_text_tokens(model_name: str, n: int) -> torch.Tensor:
    """The first n tokens of the evaluation split (documents joined by <|endoftext|>), in the
    tokenizer of model `name`."""
    from ..model import load_tokenizer

    tokenizer = load_tokenizer(model_name)
    return token_stream(tokenizer, pydoc_documents("eval"), tokenizer.special_to_id.get("<|endoftext|>"))[:n]
