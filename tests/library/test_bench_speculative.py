"""`bench speculative` end to end on the toy workloads (a smoke run; timings are never asserted)."""

import json

import pytest
import torch
from adapters import make_config, make_model

from cs336_inference.workshop.benchmarks import speculative as bench
from smollm2_reference import requires_smollm2


@pytest.mark.slow
def test_quick_bench_writes_a_consistent_table(tmp_path, monkeypatch):
    monkeypatch.setenv("CS336_FIGURES", str(tmp_path))
    result = bench.bench_speculative(quick=True, workloads=bench.toy_workloads(torch.device("cpu"), quick=True))
    saved = json.loads((tmp_path / "speculative_quick.json").read_text())
    assert (tmp_path / "speculative_quick.png").exists() and saved["rows"] == json.loads(json.dumps(result["rows"]))
    combos = {(r["workload"], r["drafter"], r["temperature"], r["gamma"]) for r in result["rows"]}
    assert len(combos) == len(result["rows"]) == (3 + 2) * 2 * 2   # drafters x temperatures x gammas (1, 4)
    for r in result["rows"]:
        assert 0 <= r["alpha"] <= 1 and 1 <= r["tokens_per_pass"] <= r["gamma"] + 1
        assert r["predicted_speedup"] > 0
        assert r["measured_speedup_min"] <= r["measured_speedup"] <= r["measured_speedup_max"]
        assert len(r["acceptance_by_position"]) == r["gamma"]


@requires_smollm2
def test_the_heads_never_train_on_the_prompts_the_proposer_bench_decodes():
    """`bench speculative_heads` trains on both tasks of every help paragraph but the held-out ones (by text:
    the help repeats some), and `bench speculative --model smollm2-135m` decodes four held-out ones and a
    held-out story."""
    from cs336_inference.data.real_text import prose_paragraphs
    from cs336_inference.model.tokenizer import load_tokenizer
    from cs336_inference.workshop.benchmarks.speculative_heads import (HELD_OUT_SUBJECT, SUBJECTS, TASKS,
                                                                        training_prompts)
    from cs336_inference.workshop.benchmarks.speculative_proposers import held_out_prompts

    tok = load_tokenizer("smollm2-135m")
    trained = "\n".join(tok.decode(p) for p in training_prompts(tok))
    decoded = "\n".join(tok.decode(p) for _, p in held_out_prompts(tok, quick=False))
    paragraphs = prose_paragraphs()
    held_out = {par for i, par in enumerate(paragraphs) if i % 5 == 1}   # the help repeats some paragraphs
    for i, par in enumerate(paragraphs):
        assert (par in decoded) == (par in paragraphs[1:20:5]), i           # the bench's four grounded prompts
        assert all((task + par in trained) == (par not in held_out) for task in TASKS), i
    assert not any(par in trained for par in held_out)
    assert HELD_OUT_SUBJECT in decoded and HELD_OUT_SUBJECT not in trained and HELD_OUT_SUBJECT not in SUBJECTS


@requires_smollm2
def test_the_engine_bench_decodes_only_held_out_paragraphs_each_under_both_tasks():
    from cs336_inference.data.real_text import prose_paragraphs
    from cs336_inference.model.tokenizer import load_tokenizer
    from cs336_inference.workshop.benchmarks.serving_speculative import real_prompts
    from cs336_inference.workshop.benchmarks.speculative_heads import TASKS, training_prompts

    tok = load_tokenizer("smollm2-135m")
    prompts = [tok.decode(p) for p in real_prompts(tok)]
    trained = "\n".join(tok.decode(p) for p in training_prompts(tok))
    paragraphs = prose_paragraphs()
    held_out = set(paragraphs[1::5])
    assert len(set(prompts)) == len(prompts) == 2 * len(held_out)
    for par in held_out:
        assert par not in trained
        assert all(sum(task + par in p for p in prompts) == 1 for task in TASKS)
    assert [TASKS[0] in p for p in prompts[:4]] == [True, False, True, False]   # concurrency 1 sees both tasks


@pytest.mark.parametrize("n, held_out", [(25, [9, 19]), (10, [9]), (8, [7]), (1, [0])])
def test_split_holds_out_every_tenth_sequence_and_at_least_one(n, held_out):
    from cs336_inference.generation.draft_training import DistillData
    from cs336_inference.workshop.benchmarks.speculative_heads import split

    data = DistillData([torch.full((3,), i) for i in range(n)], [torch.zeros(3, 2)] * n, [torch.zeros(3)] * n)
    train, val = split(data)
    assert [int(x[0]) for x in val.tokens] == held_out
    assert [int(x[0]) for x in train.tokens] == [i for i in range(n) if i not in held_out]
    assert len(train.features) == len(train.labels) == n - len(held_out) and len(val.labels) == len(held_out)


def _tiny_lm(seed: int, layers: int = 2, vocab: int = 64):
    return make_model(make_config(vocab_size=vocab, context_length=64, d_model=32, num_layers=layers, num_heads=4,
                                  num_kv_heads=2, d_ff=64), seed)


def test_the_proposer_bench_compares_the_distilled_draft_that_bench_speculative_draft_saved(tmp_path, monkeypatch):
    """`bench speculative_draft` leaves its draft in the cache folder; `bench speculative_proposers` decodes with it
    beside the heads where it is there and for this target, and says why not where it is not."""
    from cs336_inference.model import checkpoints
    from cs336_inference.workshop.benchmarks import speculative_proposers as proposers_bench

    monkeypatch.setenv("CS336_CACHE_DIR", str(tmp_path))
    path = proposers_bench.distilled_draft_path()
    assert path.is_relative_to(tmp_path)
    target = _tiny_lm(0, layers=3)
    draft, why = proposers_bench.distilled_draft(target)
    assert draft is None and str(path) in why and "bench speculative_draft" in why
    proposers, notes = proposers_bench._proposers(target)
    assert "distilled_draft" not in proposers and notes["distilled_draft"] == why

    saved = _tiny_lm(1)
    path.parent.mkdir(parents=True)
    checkpoints.save(path, saved)
    draft, why = proposers_bench.distilled_draft(target)
    assert why is None and not draft.training
    assert draft.state_dict().keys() == saved.state_dict().keys()
    assert all(torch.equal(draft.state_dict()[k], v) for k, v in saved.state_dict().items())
    proposers, notes = proposers_bench._proposers(target)
    assert "distilled_draft" in proposers and "distilled_draft" not in notes
    assert proposers_bench.GAMMAS["distilled_draft"] == bench.DRAFT_GAMMA   # as `bench speculative_draft` runs it

    checkpoints.save(path, _tiny_lm(2, vocab=65))   # a draft for another vocabulary cannot propose this target's ids
    draft, why = proposers_bench.distilled_draft(target)
    assert draft is None and "65" in why and "64" in why


@requires_smollm2
def test_the_distilled_draft_never_trains_on_a_paragraph_the_proposer_bench_decodes():
    from cs336_inference.data.real_text import prose_paragraphs
    from cs336_inference.model.tokenizer import load_tokenizer
    from cs336_inference.workshop.benchmarks.speculative_heads import held_out_paragraphs

    tok = load_tokenizer("smollm2-135m")
    text = " ".join(tok.decode(bench.draft_training_text(tok).tolist()).split())
    held_out = held_out_paragraphs()
    assert len(held_out) > 4 and not any(" ".join(par.split()) in text for par in held_out)
    assert sum(" ".join(par.split()) in text for par in prose_paragraphs() if par not in held_out) > 40
