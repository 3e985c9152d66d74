"""The passkey task: exact lengths, the needle where asked, seeded keys; and (slow) the real model
retrieving it from ~1000 tokens back, its KV-cache variants doing what their masks allow."""

import pytest
import torch
from adapters import (get_model_tokenizer, get_tokenizer, run_generate, run_load_pretrained, run_passkey_trials,
                      run_quantize_kv_cache, run_with_attention)
from cs336_inference.device import bf16_matmul_unit
from smollm2_reference import requires_smollm2


def test_trials_have_the_requested_length_depth_and_key():
    tok = get_tokenizer()  # bytes: one token per character, so positions can be read off the text
    trials = run_passkey_trials(tok, 600, 10)
    assert [t.depth for t in trials[:5]] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert len({t.key for t in trials}) == 10 and all(len(t.key) == 5 and t.key.isdigit() for t in trials)
    for t in trials:
        text = tok.decode(t.prompt_ids)
        assert len(t.prompt_ids) + len(t.answer_ids) == 600 and tok.decode(t.answer_ids) == t.key
        assert text.index(f"The pass key is {t.key}.") == t.needle_position + 1   # after its leading space
        assert text.endswith("What is the pass key? The pass key is ")
    intro = "I will quiz you about the important information there."
    first, last = (tok.decode(t.prompt_ids) for t in (trials[0], trials[4]))
    assert first.index(intro) + len(intro) == trials[0].needle_position                # depth 0: right after it
    after_needle = last[last.index(f"{trials[4].key} is the pass key.") + 26:]
    assert len(after_needle) < len("\n\nWhat is the pass key? The pass key is ") + 24  # depth 1: < a sentence left
    positions = [t.needle_position for t in trials[:5]]
    assert positions == sorted(positions)
    assert run_passkey_trials(tok, 600, 10) == trials                              # seeded
    with pytest.raises(ValueError, match="too short"):
        run_passkey_trials(tok, 100, 1)


@pytest.mark.slow
@requires_smollm2
@pytest.mark.usefixtures("one_thread")
def test_smollm2_retrieves_a_passkey_from_1000_tokens_and_a_window_cannot():
    # bf16 as `bench long_context` runs it, where the CPU multiplies bf16 natively; elsewhere (AVX2) torch
    # converts every bf16 matmul to fp32 and the test took 8 minutes, so it runs in fp32 there
    dtype = torch.float32 if bf16_matmul_unit("cpu").startswith("none") else torch.bfloat16
    model, tok = run_load_pretrained("smollm2-135m", dtype=dtype), get_model_tokenizer("smollm2-135m")
    trials = run_passkey_trials(tok, 1000, 2, depths=(0.0, 0.5))   # needle ~950 and ~480 tokens back
    window = run_with_attention(model, sliding_window=256, attention_sinks=4)

    def retrieved(m, trial, kv=None):
        cache = m.new_cache(1, 1000)
        with torch.inference_mode():
            last = m(torch.tensor([trial.prompt_ids]), cache=cache)[0, -1]
            if kv:
                run_quantize_kv_cache(cache, kv)
            rest = m(torch.tensor([trial.answer_ids[:-1]]), cache=cache, start_pos=cache.length)[0]
        return torch.cat([last[None], rest]).argmax(-1).tolist() == trial.answer_ids

    assert all(retrieved(model, t) for t in trials), "full attention must find every key"
    greedy = run_generate(model, [trials[0].prompt_ids], 5).tokens[0]   # what the check above stands for
    assert tok.decode(greedy) == trials[0].key
    assert all(retrieved(model, t, "int8") for t in trials), "an int8 cache must still find every key"
    assert not any(retrieved(window, t) for t in trials), "a 256-token window cannot see ~500+ tokens back"
