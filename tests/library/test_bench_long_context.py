"""The long-context benchmark's shortcuts are exact: a window covering the sequence scores like full
attention, the KV formats quantize the very prefill they share, and teacher-forced scoring
(`data.passkey.score_trial`) agrees with greedy decoding. Checked on the shipped toy model (fast); the
real run is `bench long_context`."""

import copy

import pytest
import torch
from adapters import get_tokenizer, run_generate, run_passkey_trials, run_quantize_kv_cache, run_with_attention

from cs336_inference.workshop.benchmarks import long_context as bench
from cs336_inference.data.passkey import prefill_trial, score_trial
from cs336_inference.model import checkpoints

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def setup():
    return checkpoints.load_pretrained("target"), get_tokenizer()


def test_a_window_that_covers_the_sequence_scores_exactly_like_full_attention(setup):
    model, tok = setup
    window = run_with_attention(model, sliding_window=400, attention_sinks=4)
    for trial in run_passkey_trials(tok, 400, 2):
        assert bench._window_covers(dict(changes=dict(sliding_window=400)), trial.context)
        scores = [score_trial(m, *prefill_trial(m, trial), trial) for m in (model, window)]
        assert scores[0][0] == scores[1][0] and scores[0][1] == pytest.approx(scores[1][1], abs=1e-4)


def test_teacher_forced_score_is_greedy_decoding(setup):
    model, tok = setup
    for trial in run_passkey_trials(tok, 300, 3):
        cache, last = prefill_trial(model, trial)
        correct, logprob = score_trial(model, cache, last, trial)
        greedy = run_generate(model, [trial.prompt_ids], len(trial.answer_ids)).tokens[0]
        assert correct == (greedy == trial.answer_ids)
        # the answer's log-probability, from a plain full forward of prompt + answer
        ids = torch.tensor([trial.prompt_ids + trial.answer_ids])
        with torch.no_grad():
            logp = model(ids[:, :-1])[0, -len(trial.answer_ids):].log_softmax(-1)
        assert logprob == pytest.approx(float(logp.gather(1, ids[0, -len(trial.answer_ids):, None]).sum()), abs=1e-3)


def test_kv_formats_share_the_full_prefill_without_touching_it(setup):
    model, tok = setup
    trial = run_passkey_trials(tok, 300, 1)[0]
    cache, last = prefill_trial(model, trial)
    before = [layer.k.clone() for layer in cache.layers]
    quantized = run_quantize_kv_cache(copy.copy(cache), "int4")
    score_trial(model, quantized, last, trial)
    assert cache.length == len(trial.prompt_ids) and quantized.length == cache.length + len(trial.answer_ids) - 1
    assert all(torch.equal(a, layer.k) for a, layer in zip(before, cache.layers))
    names = [v["name"] for v in bench.variants()]
    assert names[0].startswith("full attention") and len(set(names)) == len(names) == 13
