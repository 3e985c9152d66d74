"""Graded: the engine's postprocess bookkeeping, `num_computed_tokens` (vLLM v1's name) after prefill chunks,
decodes and preemptions by recompute. References are written here: cases worked by hand, and a random run
checked step by step against a few lines that state the rules (`ref_postprocess`)."""

import random

import pytest
from adapters import run_postprocess_step


def seq(seq_id, prompt, generated=(), computed=0, max_tokens=4):
    return {"seq_id": seq_id, "prompt_len": len(prompt), "token_ids": list(prompt) + list(generated),
            "num_computed_tokens": computed, "max_tokens": max_tokens}


def ref_postprocess(sequences, scheduled, sampled, preempted):
    """The rules, one sequence at a time."""
    out = []
    for s in sequences:
        s = {**s, "token_ids": list(s["token_ids"]), "finished": False}
        if s["seq_id"] in preempted:
            s["num_computed_tokens"] = 0
        elif s["seq_id"] in scheduled:
            s["num_computed_tokens"] += scheduled[s["seq_id"]]
            if s["num_computed_tokens"] == len(s["token_ids"]):
                s["token_ids"].append(sampled[s["seq_id"]])
                s["finished"] = len(s["token_ids"]) - s["prompt_len"] >= s["max_tokens"]
        out.append(s)
    return out


def _check(got, want):
    assert isinstance(got, list) and len(got) == len(want)
    for g, w in zip(got, want):
        for key in ("seq_id", "token_ids", "num_computed_tokens", "finished"):
            assert g[key] == w[key], f"sequence {w['seq_id']}: {key} is {g[key]!r}, expected {w[key]!r}"


def test_a_prefill_in_chunks_then_its_first_token():
    """A 10-token prompt prefilled 4 + 4 + 2: no token until the last chunk; then 10 computed, 11 tokens."""
    s = [seq(0, range(100, 110))]
    s = run_postprocess_step(s, {0: 4}, {0: 7}, [])
    _check(s, [{**seq(0, range(100, 110), computed=4), "finished": False}])
    s = run_postprocess_step(s, {0: 4}, {0: 7}, [])
    assert s[0]["num_computed_tokens"] == 8 and len(s[0]["token_ids"]) == 10
    s = run_postprocess_step(s, {0: 2}, {0: 7}, [])
    _check(s, [{**seq(0, range(100, 110), [7], computed=10), "finished": False}])
    s = run_postprocess_step(s, {0: 1}, {0: 8}, [])                       # a decode runs the token 7
    _check(s, [{**seq(0, range(100, 110), [7, 8], computed=11), "finished": False}])


def test_a_preempted_sequence_recomputes_prompt_and_output_then_continues():
    """Preemption by recompute: the cache is gone (0 computed), the tokens stay; readmitted, it prefills all
    of them (prompt + its 2 outputs) and its next token is its third output."""
    s = [seq(0, [1, 2, 3], [9, 8], computed=4, max_tokens=3), seq(1, [5, 6], [4], computed=2)]
    s = run_postprocess_step(s, {1: 1}, {1: 3}, [0])
    _check(s, [{**seq(0, [1, 2, 3], [9, 8], computed=0), "finished": False},
               {**seq(1, [5, 6], [4, 3], computed=3), "finished": False}])
    s = run_postprocess_step(s, {0: 5, 1: 1}, {0: 6, 1: 2}, [])
    _check(s, [{**seq(0, [1, 2, 3], [9, 8, 6], computed=5), "finished": True},   # max_tokens = 3 reached
               {**seq(1, [5, 6], [4, 3, 2], computed=4), "finished": False}])


def test_a_readmission_in_chunks_samples_only_after_the_last_one():
    s = [seq(0, [1, 2, 3, 4], [9, 9], computed=0, max_tokens=5)]
    s = run_postprocess_step(s, {0: 4}, {0: 1}, [])
    _check(s, [{**seq(0, [1, 2, 3, 4], [9, 9], computed=4), "finished": False}])
    s = run_postprocess_step(s, {0: 2}, {0: 5}, [])
    _check(s, [{**seq(0, [1, 2, 3, 4], [9, 9, 5], computed=6), "finished": False}])


def test_unscheduled_sequences_are_unchanged_and_the_input_is_not_modified():
    s = [seq(0, [1, 2], [3], computed=2), seq(1, [4, 5, 6], computed=1)]
    before = [dict(x, token_ids=list(x["token_ids"])) for x in s]
    got = run_postprocess_step(s, {}, {}, [])
    _check(got, [{**x, "finished": False} for x in before])


@pytest.mark.parametrize("seed", range(3))
def test_random_runs_follow_the_rules_step_by_step(seed):
    rng = random.Random(seed)
    seqs = [seq(i, [rng.randrange(50) for _ in range(rng.randint(1, 9))], max_tokens=rng.randint(1, 6))
            for i in range(5)]
    finished = set()
    for _ in range(40):
        live = [s for s in seqs if s["seq_id"] not in finished]
        if not live:
            break
        preempted = [s["seq_id"] for s in live if s["num_computed_tokens"] and rng.random() < 0.15]
        scheduled = {}
        for s in live:
            left = len(s["token_ids"]) - s["num_computed_tokens"]
            if s["seq_id"] not in preempted and rng.random() < 0.8:
                scheduled[s["seq_id"]] = rng.randint(1, left)              # a chunk, the rest, or a decode
        sampled = {i: rng.randrange(50) for i in scheduled}
        got = run_postprocess_step(live, scheduled, sampled, preempted)
        want = ref_postprocess(live, scheduled, sampled, preempted)
        _check(got, want)
        by_id = {w["seq_id"]: w for w in want}
        seqs = [by_id.get(s["seq_id"], s) for s in seqs]
        finished |= {w["seq_id"] for w in want if w["finished"]}
    assert finished, "the run should finish some sequences"
