"""The quality gate: the default real-model path answers everyday questions at least as right as fp32,
without loops, and a greedy request answers the same alone and batched on the serving engine.

Not graded: this checks the library's own defaults (`fast_path`) and question set (`data.everyday_questions`).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from smollm2_reference import requires_smollm2

from cs336_inference.data.everyday_questions import QUESTIONS, Question, answer, grade, has_loop, strip_stop

MODEL = "smollm2-135m"


def loops_by_counting(ids, n, times) -> bool:
    """has_loop's definition, counted another way: every n-gram's count at once."""
    grams = Counter(tuple(ids[i:i + n]) for i in range(len(ids) - n + 1))
    return any(c >= times for c in grams.values())


def test_the_question_set_is_large_enough_and_each_has_keywords():
    assert len(QUESTIONS) >= 30
    assert len({q.prompt for q in QUESTIONS}) == len(QUESTIONS)
    assert all(q.keywords and all(k.strip() for k in q.keywords) for q in QUESTIONS)


def test_keywords_match_whole_words_in_any_case():
    four = Question("What is 2 plus 2?", ("4", "four"))
    assert four.is_right("2 plus 2 is 4.") and four.is_right("It is Four")
    assert not four.is_right("It is 14") and not four.is_right("fourteen") and not four.is_right("4-wheel")
    pair = Question("?", ("carbon dioxide",))
    assert pair.is_right("Plants take in Carbon Dioxide.") and not pair.is_right("carbon, then dioxide")


@pytest.mark.parametrize("seed", range(6))
def test_has_loop_agrees_with_counting_every_ngram(seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(50):
        ids = torch.randint(0, 3 + seed, (int(torch.randint(0, 40, (1,), generator=g)),), generator=g).tolist()
        for n, times in ((1, 3), (2, 2), (4, 3), (3, 5)):
            assert has_loop(ids, n, times) == loops_by_counting(ids, n, times), (ids, n, times)


def test_has_loop_on_answers_a_reader_would_judge():
    cycle = [5, 6, 7, 8] * 3
    assert has_loop([1, 2] + cycle + [9])                     # the same 4 tokens three times
    assert not has_loop([1, 2, 3, 4, 1, 2, 3, 4, 9, 10])       # twice is a restatement, not a loop
    assert not has_loop([])
    with pytest.raises(TypeError, match="n"):
        has_loop([1, 2], n=1.5)
    with pytest.raises(ValueError, match="times"):
        has_loop([1, 2], times=0)


def test_grade_and_strip_stop():
    class Words:   # a tokenizer whose ids are words
        words = ["Paris", "is", "it", "Lyon", "<end>"]

        def decode(self, ids):
            return " ".join(self.words[i] for i in ids)
    qs = [Question("capital of France?", ("Paris",)), Question("capital of France?", ("Paris",))]
    assert strip_stop([2, 1, 0, 4, 3], [4]) == [2, 1, 0] and strip_stop([3, 3], [4]) == [3, 3]
    graded = grade(qs, [[2, 1, 0], [3, 1, 3, 1, 3, 1]], Words())
    assert graded["right"] == 1 and graded["loops"] == 0
    assert [r["right"] for r in graded["questions"]] == [True, False]
    with pytest.raises(ValueError, match="one entry per question"):
        grade(qs, [[0]], Words())


@pytest.fixture(scope="module")
def default_path():
    from cs336_inference.workshop.fast_path import load_for_inference

    model, tokenizer, banner = load_for_inference(MODEL)
    return model, tokenizer, banner


@requires_smollm2
def test_the_default_weights_and_activations_say_paris():
    """The README's first question, on the default path's model (int4-exact weights, the activations
    `fast_path` picks for them: fp32), without the CPU tuning (slow to set up): the first token is a
    near-tie (fp32 logits "The" 25.325, "L" 25.243) that bf16 activations rounded together."""
    from cs336_inference import load_pretrained, load_tokenizer
    from cs336_inference.workshop import fast_path

    dtype = getattr(torch, fast_path.EXACT_ACTIVATIONS)
    assert dtype == torch.float32
    model = load_pretrained(MODEL, dtype=dtype, weights="gguf-exact")
    tokenizer = load_tokenizer(MODEL)
    (ids,) = answer(model, tokenizer, QUESTIONS[:1], max_new_tokens=10)
    assert "Paris" in tokenizer.decode(ids), tokenizer.decode(ids)


@pytest.mark.slow
@requires_smollm2
def test_the_banner_says_what_runs(default_path):
    model, _, banner = default_path
    assert model.dtype == torch.float32 and "int4-exact weights, float32 activations" in banner


@pytest.mark.slow
@requires_smollm2
def test_the_default_path_is_as_right_as_fp32_on_everyday_questions(default_path):
    from cs336_inference.workshop.fast_path import load_for_inference

    model, tokenizer, _ = default_path
    fp32, _, _ = load_for_inference(MODEL, precision="fp32")
    ours = grade(QUESTIONS, answer(model, tokenizer, QUESTIONS), tokenizer)
    reference = grade(QUESTIONS, answer(fp32, tokenizer, QUESTIONS), tokenizer)
    wrong = [r["prompt"] for r, f in zip(ours["questions"], reference["questions"]) if f["right"] and not r["right"]]
    assert ours["right"] >= reference["right"], (ours["right"], reference["right"], wrong)
    if reference["loops"] == 0:
        assert ours["loops"] == 0, [r for r in ours["questions"] if r["loop"]]


@pytest.mark.slow
@requires_smollm2
def test_a_request_answers_the_same_alone_and_batched_with_15_others(default_path):
    """Batch invariance on the serving engine (eager, as `serve --no-compile`): 16 questions served one at
    a time, then admitted together (their prompts prefilled in one forward, decoded 16 at a time)."""
    from cs336_inference.workshop.benchmarks.quality import serve_alone_and_together

    model, tokenizer, _ = default_path
    alone, together = serve_alone_and_together(model, tokenizer, QUESTIONS[:16], 24)
    differ = [(QUESTIONS[i].prompt, tokenizer.decode(a), tokenizer.decode(b))
              for i, (a, b) in enumerate(zip(alone, together)) if a != b]
    assert not differ, differ
    assert any("Paris" in tokenizer.decode(a) for a in alone[:1])
