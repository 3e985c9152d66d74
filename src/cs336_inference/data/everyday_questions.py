"""Short everyday questions with the words a right answer contains: the quality gate of a model's chat path.

A newcomer's first question is something like "What is the capital of France?". Whether a path answers
it right is decided by greedy decoding, which follows the argmax: a speed-up that rounds two close
logits together (bf16 activations, say) can swap the first token and send the whole answer elsewhere,
while perplexity-style averages barely move. So the gate asks questions a 135M-parameter chat model
mostly knows (capitals, colours, arithmetic, animals, the sky and the planets), greedily, and counts
the answers that contain an expected word and those that loop (`has_loop`). A fast path must be at
least as right as the fp32 reference on them (`bench quality`, `tests/library/test_quality_gate.py`).

`answer(model, tokenizer, questions)` asks each question alone (batch 1, the chat template, stop at the
end of the turn); `grade(questions, answers)` scores the answers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from .. import _checks
from ..generation.generate import generate


@dataclass(frozen=True)
class Question:
    prompt: str                 # the user's message
    keywords: tuple[str, ...]   # a right answer contains one of these words (any case, whole words)

    def is_right(self, answer: str) -> bool:
        return any(re.search(rf"(?<![\w-]){re.escape(k)}(?![\w-])", answer, re.IGNORECASE) for k in self.keywords)


def _q(prompt: str, *keywords: str) -> Question:
    return Question(prompt, keywords)


QUESTIONS: tuple[Question, ...] = (
    _q("What is the capital of France?", "Paris"),
    _q("What is the capital of Japan?", "Tokyo"),
    _q("What is the capital of Italy?", "Rome"),
    _q("What is the capital of Germany?", "Berlin"),
    _q("What is the capital of Spain?", "Madrid"),
    _q("What is the capital of England?", "London"),
    _q("What is the capital of Russia?", "Moscow"),
    _q("What is the capital of Egypt?", "Cairo"),
    _q("What color is the sky on a clear day?", "blue"),
    _q("What color is grass?", "green"),
    _q("What color is a ripe banana?", "yellow"),
    _q("What color is fresh snow?", "white"),
    _q("What color do you get when you mix blue and yellow?", "green"),
    _q("What is 2 plus 2?", "4", "four"),
    _q("What is 10 minus 3?", "7", "seven"),
    _q("What is 3 times 3?", "9", "nine"),
    _q("How many legs does a spider have?", "8", "eight"),
    _q("How many legs does a dog have?", "4", "four"),
    _q("How many days are there in a week?", "7", "seven"),
    _q("How many months are there in a year?", "12", "twelve"),
    _q("How many hours are there in a day?", "24", "twenty-four"),
    _q("Which animal is called the king of the jungle?", "lion"),
    _q("Which farm animal says moo?", "cow", "cows"),
    _q("Which insect makes honey?", "bee", "bees", "honeybee", "honeybees"),
    _q("What is the largest planet in our solar system?", "Jupiter"),
    _q("Which planet do we live on?", "Earth"),
    _q("What is the star at the center of our solar system?", "Sun"),
    _q("What gas do plants take in from the air to make food?", "carbon dioxide", "CO2"),
    _q("What do we call water when it freezes?", "ice"),
    _q("At what temperature in degrees Celsius does water boil at sea level?", "100"),
    _q("Who wrote Romeo and Juliet?", "Shakespeare"),
    _q("What is the largest ocean on Earth?", "Pacific"),
    _q("What language do people speak in Brazil?", "Portuguese"),
    _q("What is the opposite of hot?", "cold"),
    _q("Which animal has a very long neck and lives in Africa?", "giraffe", "giraffes"),
    _q("What is the chemical formula of water?", "H2O"),
    _q("How many continents are there on Earth?", "7", "seven"),
    _q("Which fruit is wine usually made from?", "grape", "grapes"),
)


def has_loop(token_ids, n: int = 4, times: int = 3) -> bool:
    """Whether some run of `n` tokens occurs `times` times or more in `token_ids` (a greedy answer stuck in a
    cycle repeats its phrase; an answer that merely reuses a word or two does not)."""
    ids = [int(t) for t in token_ids]
    n, times = _checks.positive_int("n", n), _checks.positive_int("times", times)
    counts: dict[tuple[int, ...], int] = {}
    for i in range(len(ids) - n + 1):
        gram = tuple(ids[i:i + n])
        counts[gram] = counts.get(gram, 0) + 1
        if counts[gram] >= times:
            return True
    return False


def chat_prompt(tokenizer, question: Question) -> list[int]:
    """The question as one user turn in the model's chat format, ready for the assistant's answer."""
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question.prompt}]))


@torch.inference_mode()
def answer(model, tokenizer, questions=QUESTIONS, max_new_tokens: int = 40, decode=None) -> list[list[int]]:
    """Each question's greedy answer, asked alone (batch 1), without the stop token that ended it.
    decode: None (`generate`), or a function (model, prompt ids (list), max_new_tokens, stop ids) -> ids."""
    _checks.positive_int("max_new_tokens", max_new_tokens)
    stop = list(tokenizer.stop_ids)
    out = []
    for q in questions:
        prompt = chat_prompt(tokenizer, q)
        if decode is None:
            ids = generate(model, torch.tensor([prompt], device=model.device), max_new_tokens,
                           stop_tokens=stop).tokens[0]
        else:
            ids = list(decode(model, prompt, max_new_tokens, stop))
        out.append(strip_stop(ids, stop))
    return out


def strip_stop(ids: list[int], stop) -> list[int]:
    """The answer up to (not including) its first stop token."""
    stop = set(stop)
    return next((ids[:i] for i, t in enumerate(ids) if t in stop), ids)


def grade(questions, answers: list[list[int]], tokenizer) -> dict:
    """{"right", "loops", "questions": one row per question (prompt, answer text, right, loop)}."""
    questions = list(questions)
    if len(questions) != len(answers):
        raise ValueError(f"answers must have one entry per question ({len(questions)}), got {len(answers)}")
    rows = []
    for q, ids in zip(questions, answers):
        text = tokenizer.decode(ids)
        rows.append(dict(prompt=q.prompt, answer=text, right=q.is_right(text), loop=has_loop(ids)))
    return dict(right=sum(r["right"] for r in rows), loops=sum(r["loop"] for r in rows), questions=rows)


__all__ = ["QUESTIONS", "Question", "answer", "chat_prompt", "grade", "has_loop", "strip_stop"]
