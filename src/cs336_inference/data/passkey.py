"""The passkey retrieval task: a random 5-digit key hidden in filler text, asked for at the end.

Mohtashami & Jaggi 2023 (Landmark Attention) introduced it; Chen et al. 2023 (LongLoRA) and Xiao et
al. 2024 (StreamingLLM) use it to test whether a model can still *see* a token n positions back. The
filler is repetitive, so only the key itself is information; the needle sits at a chosen depth
(0 = right after the instructions, 1 = right before the question), and the prompt plus answer is
exactly `context` tokens of the model's own tokenizer. Seeded: the same arguments give the same trials.

Scoring a trial needs no generation loop: greedy decoding emits the key iff each answer token is the
argmax given the ones before it, which one teacher-forced forward of the answer checks
(`prefill_trial`, then `score_trial`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

# Pieces are tokenized separately and joined, so each starts with its space (" The") as running text would.
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.")
FILLER = [" The grass is green.", " The sky is blue.", " The sun is yellow.", " Here we go.", " There and back again."]
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
# The prompt ends with the space before the key (a token of its own, as digits are split one by one), so
# the first answer token is already a digit: the test is recall, not the model's choice of phrasing.
QUESTION = "\n\nWhat is the pass key? The pass key is "


@dataclass(frozen=True)
class PasskeyTrial:
    prompt_ids: list[int]
    answer_ids: list[int]      # "12345" (one token per digit): what greedy decoding must produce
    key: str
    depth: float               # requested depth in [0, 1]
    needle_position: int       # index of the needle's first token in the prompt
    context: int               # len(prompt_ids) + len(answer_ids)

    @property
    def distance(self) -> int:
        """Tokens from the needle's start to the first answer token: how far back the model must look."""
        return len(self.prompt_ids) - self.needle_position


def make_passkey_trial(tokenizer, context: int, depth: float, seed: int) -> PasskeyTrial:
    """One prompt of exactly `context` tokens (with its answer) hiding a seeded 5-digit key at `depth`."""
    if isinstance(context, bool) or not isinstance(context, int):
        raise TypeError(f"context must be an int (tokens), got {type(context).__name__}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    key = str(random.Random(seed).randint(10000, 99999))
    head, needle, question = (tokenizer.encode(t) for t in (INTRO, NEEDLE.format(key=key), QUESTION))
    answer = tokenizer.encode(key)
    room = context - len(head) - len(needle) - len(question) - len(answer)
    if room < 0:
        raise ValueError(f"context={context} is too short for the passkey prompt: it needs at least "
                         f"{context - room} tokens")
    sentences = [tokenizer.encode(s) for s in FILLER]
    filler: list[int] = []
    boundaries = [0]                                   # token offsets where a filler sentence starts
    while len(filler) < room:
        filler += sentences[(len(boundaries) - 1) % len(sentences)]
        boundaries.append(len(filler))
    filler = filler[:room]                             # exact length: the last sentence may be cut
    cut = min((b for b in boundaries if b <= room), key=lambda b: abs(b - depth * room))
    prompt = head + filler[:cut] + needle + filler[cut:] + question
    return PasskeyTrial(prompt, answer, key, depth, len(head) + cut, context)


def passkey_trials(tokenizer, context: int, num_trials: int, depths=(0.0, 0.25, 0.5, 0.75, 1.0),
                   seed: int = 0) -> list[PasskeyTrial]:
    """`num_trials` trials at one context length, cycling through `depths`, each with its own key."""
    if isinstance(num_trials, bool) or not isinstance(num_trials, int) or num_trials <= 0:
        raise ValueError(f"num_trials must be a positive int, got {num_trials!r}")
    depths = list(depths)
    if not depths:
        raise ValueError("depths must be a non-empty list of numbers in [0, 1]")
    return [make_passkey_trial(tokenizer, context, depths[t % len(depths)], seed * 1_000_003 + context * 1009 + t)
            for t in range(num_trials)]


@torch.inference_mode()
def prefill_trial(model, trial: PasskeyTrial, extra: int = 0, chunk: int = 256):
    """Prefill `trial`'s prompt in chunks of `chunk` tokens (as vLLM and Sarathi do: the same math, but
    a windowed layer attends over window + chunk keys instead of the whole prompt) into a fresh cache
    with room for its answer and `extra` more tokens; returns (cache, logits (V,) at the last prompt
    position)."""
    prompt = torch.tensor([trial.prompt_ids], device=model.device)
    cache = model.new_cache(1, prompt.shape[1] + len(trial.answer_ids) + extra)
    for start in range(0, prompt.shape[1], chunk):
        logits = model(prompt[:, start:start + chunk], cache=cache, start_pos=start, last_only=True)
    return cache, logits[0, -1]


@torch.inference_mode()
def score_trial(model, cache, last_logits: torch.Tensor, trial: PasskeyTrial) -> tuple[bool, float]:
    """Teacher-forced answer after the prompt in `cache`: (greedy decoding would emit the key, the
    answer's log-probability in nats)."""
    answer = torch.tensor(trial.answer_ids, device=model.device)
    rest = model(answer[None, :-1], cache=cache, start_pos=cache.length)[0]            # (A-1, V)
    logits = torch.cat([last_logits.reshape(1, -1), rest]).float()                     # (A, V)
    correct = bool((logits.argmax(-1) == answer).all())
    return correct, float(logits.log_softmax(-1).gather(1, answer[:, None]).sum())
