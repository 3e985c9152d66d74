"""The offline training corpus, its fixed train/validation split, batches, and the recall probe.

The corpus is built at run time from two sources present on every machine, so no third-party text
is committed and nothing is downloaded:
  * a seeded grammar (`grammar.py`): stories, dialogues and key-value ledgers whose entities are
    named early and recalled hundreds of bytes later (long-range structure), and
  * the English reference text that ships with CPython (`pydoc_data.topics`).
Same seed and Python version -> the same bytes. Documents are joined by "<|endoftext|>"; every
20th document (a fixed rule on the document index) is validation, so the split never overlaps.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import numpy as np
import torch

from .. import _checks
from . import grammar
from ..model.tokenizer import ENDOFTEXT, ByteTokenizer

SPLITS = ("train", "val")
VAL_EVERY = 20                    # document i is validation iff i % VAL_EVERY == VAL_EVERY - 1
GRAMMAR_BYTES = 3_600_000         # grammar text per corpus (pydoc adds ~0.45 MB)
KIND_WEIGHTS = {"ledger": 0.3, "echo": 0.4, "story": 0.15, "dialogue": 0.15}
PYDOC_CHUNK = 2000                # pydoc topics are cut into documents of about this many bytes


def _pydoc_documents() -> list[str]:
    """CPython's own help text (`help('if')` etc.), cut at paragraph breaks into ~2 kB documents.

    Some topics quote others word for word; repeated paragraphs are dropped so that no text can be
    in both the train and the validation split.
    """
    from pydoc_data.topics import topics

    docs, seen = [], set()
    for name in sorted(topics):
        chunk = ""
        for paragraph in topics[name].split("\n\n"):
            if paragraph.strip() in seen:
                continue
            seen.add(paragraph.strip())
            chunk = f"{chunk}\n\n{paragraph}" if chunk else paragraph
            if len(chunk) >= PYDOC_CHUNK:
                docs.append(chunk)
                chunk = ""
        if chunk.strip():
            docs.append(chunk)
    return docs


def build_documents(seed: int = 0) -> list[str]:
    """The corpus as a list of documents, in corpus order (grammar and pydoc shuffled together)."""
    _checks.non_negative_int("seed", seed)
    rng = random.Random(seed)
    kinds, weights = list(KIND_WEIGHTS), list(KIND_WEIGHTS.values())
    docs, size = [], 0
    while size < GRAMMAR_BYTES:
        doc = grammar.GENERATORS[rng.choices(kinds, weights)[0]](rng)
        docs.append(doc)
        size += len(doc)
    docs.extend(_pydoc_documents())
    rng.shuffle(docs)
    return docs


@functools.lru_cache(maxsize=4)
def build_corpus(seed: int = 0) -> bytes:
    """All documents joined by "<|endoftext|>", UTF-8 encoded (~4 MB; cached in memory)."""
    return ENDOFTEXT.join(build_documents(seed)).encode("utf-8")


def corpus_documents(split: str = "val", seed: int = 0) -> list[str]:
    """The documents of one split ("train" or "val"), in corpus order (what `load_corpus` joins)."""
    _checks.one_of("split", split, SPLITS)
    docs = build_corpus(seed).decode("utf-8").split(ENDOFTEXT)
    return [d for i, d in enumerate(docs) if (i % VAL_EVERY == VAL_EVERY - 1) == (split == "val")]


@functools.lru_cache(maxsize=8)
def _split_ids(split: str, seed: int) -> torch.Tensor:
    eot = ByteTokenizer().eot_id
    pieces = []
    for doc in corpus_documents(split, seed):
        pieces.append(np.frombuffer(doc.encode("utf-8"), dtype=np.uint8).astype(np.int64))
        pieces.append(np.array([eot], dtype=np.int64))
    return torch.from_numpy(np.concatenate(pieces))


def load_corpus(split: str = "train", seed: int = 0) -> torch.Tensor:
    """1-D long tensor of ByteTokenizer ids (bytes 0..255, 256 = <|endoftext|> after each document)."""
    _checks.one_of("split", split, SPLITS)
    _checks.non_negative_int("seed", seed)
    return _split_ids(split, seed).clone()  # a copy: callers may modify theirs freely


def get_batch(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator | None = None,
              device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of `data`: inputs x (B, T) and next-token targets y (B, T) = x shifted by one."""
    if not isinstance(data, torch.Tensor) or data.dim() != 1:
        raise ValueError(f"data must be a 1-D tensor of token ids, got {getattr(data, 'shape', type(data))}")
    _checks.positive_ints(batch_size=batch_size, seq_len=seq_len)
    if data.numel() < seq_len + 1:
        raise ValueError(f"data has {data.numel()} tokens, need at least seq_len + 1 = {seq_len + 1}")
    starts = torch.randint(0, data.numel() - seq_len, (batch_size,), generator=generator)  # (B,)
    offsets = torch.arange(seq_len + 1)
    windows = data[starts[:, None] + offsets[None, :]]  # (B, T + 1)
    x, y = windows[:, :-1], windows[:, 1:]
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y


# --- the long-range recall probe ------------------------------------------------------------------

@dataclass
class RecallProbe:
    """A ledger prompt whose last fact-check must copy a value stated `distance` tokens earlier."""

    prompt: str
    answer: str          # the digits the model must produce next
    key: str
    distance: int        # tokens from the value in the fact to the position that must predict it
    num_items: int

    @property
    def prompt_ids(self) -> list[int]:
        return ByteTokenizer().encode(self.prompt)

    @property
    def answer_ids(self) -> list[int]:
        return ByteTokenizer().encode(self.answer)


def make_recall_probe(num_items: int, distance: int, seed: int = 0, digits: int = 3) -> RecallProbe:
    """A prompt in the corpus's ledger format: the queried fact, ~`distance` bytes of filler with
    `num_items - 1` distractor facts inside, then "Check: NAME's code is " (the answer follows).

    The distance is met to within one filler sentence; the exact value is in `probe.distance`.
    """
    _checks.integer("num_items", num_items, 1, len(grammar.NAMES),
                    allowed=f"an int in [1, {len(grammar.NAMES)}] (one distinct name per item)")
    _checks.positive_ints(distance=distance, digits=digits)
    _checks.non_negative_int("seed", seed)
    rng = random.Random(seed)
    names = rng.sample(grammar.NAMES, num_items)
    values = [grammar.random_value(rng, digits) for _ in names]
    key, answer = names[0], values[0]
    head = f"Ledger {rng.randint(1, 9999)}.\n" + grammar.fact_prefix(key)
    query = "\n" + grammar.query_prefix(key)
    distractors = [grammar.fact_line(n, v) for n, v in zip(names[1:], values[1:])]
    fixed = len(answer) + 2 + sum(len(d) + 1 for d in distractors) + len(query)  # ".\n" after the value
    if distance < fixed:
        raise ValueError(f"distance must be >= {fixed} for num_items={num_items} (the facts and the "
                         f"query alone take that many bytes), got {distance}")
    sentences, size = [], fixed
    for _ in range(200):  # fill the gap with whole sentences, skipping those that overshoot
        sentence = grammar.filler_sentence(rng)
        if size + len(sentence) + 1 <= distance:
            sentences.append(sentence)
            size += len(sentence) + 1
        if distance - size < 12:
            break
    # Distractor facts on their own lines at random places; filler sentences form paragraphs as in
    # the corpus's ledgers (every separator is one byte, so the length is unchanged).
    items: list[tuple[bool, str]] = [(False, s) for s in sentences]
    for d in distractors:
        items.insert(rng.randint(0, len(items)), (True, d))
    body = ""
    for i, (is_fact, piece) in enumerate(items):
        sep = "" if i == 0 else ("\n" if is_fact or items[i - 1][0] else " ")
        body += sep + piece
    prompt = head + answer + "." + ("\n" + body if body else "") + query
    value_pos = len(head.encode("utf-8"))
    return RecallProbe(prompt=prompt, answer=answer, key=key, distance=len(prompt.encode("utf-8")) - value_pos,
                       num_items=num_items)

