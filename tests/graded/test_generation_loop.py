"""Graded: the greedy generation loop over a batch (greedy_generate). The reference decodes each prompt
alone with full forwards of a naive model written from the math (reference_model.ref_forward)."""

import torch
from adapters import make_config, make_model, run_greedy_generate
from reference_model import ref_forward

CFG = dict(vocab_size=61, context_length=48, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48,
           rope_theta=500.0)
PROMPTS = [[5], [7, 3, 9, 1, 2, 8], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 11], [30, 2, 17]]   # 1 to 13 tokens


def _model():
    cfg = make_config(**CFG)
    return cfg, make_model(cfg, seed=3)


def ref_greedy(state, cfg, prompt, steps, stop=()):
    seq, out = list(prompt), []
    for _ in range(steps):
        with torch.no_grad():
            token = int(ref_forward(state, cfg, torch.tensor([seq]))[0, -1].argmax())
        seq.append(token)
        out.append(token)
        if token in stop:
            break
    return out


def test_a_ragged_batch_decodes_as_each_prompt_alone():
    cfg, model = _model()
    state = {k: v.detach() for k, v in model.state_dict().items()}
    want = [ref_greedy(state, cfg, p, 8) for p in PROMPTS]          # computed before the graded call
    got = run_greedy_generate(model, PROMPTS, 8)
    assert got == want, f"got {got}\nwant {want}"


def test_a_stop_token_ends_its_sequence_and_is_part_of_the_output():
    cfg, model = _model()
    state = {k: v.detach() for k, v in model.state_dict().items()}
    free = [ref_greedy(state, cfg, p, 10) for p in PROMPTS]
    # a token some sequence first produces midway (not first, not last): it stops there
    stop = next(t for out in free for i, t in enumerate(out) if 1 <= i < len(out) - 1 and t not in out[:i])
    want = [ref_greedy(state, cfg, p, 10, stop=(stop,)) for p in PROMPTS]
    assert any(1 < len(w) < 10 and w[-1] == stop for w in want)
    got = run_greedy_generate(model, PROMPTS, 10, [stop])
    assert got == want, f"stop token {stop}: got {got}\nwant {want}"
    prompt_stop = PROMPTS[2][0]                                     # a stop token inside a prompt ends nothing
    want = [ref_greedy(state, cfg, p, 5, stop=(prompt_stop,)) for p in PROMPTS]
    assert run_greedy_generate(model, PROMPTS, 5, [prompt_stop]) == want


def test_zero_new_tokens_and_no_stop_tokens():
    _, model = _model()
    assert run_greedy_generate(model, PROMPTS, 0) == [[], [], [], []]
    assert [len(t) for t in run_greedy_generate(model, PROMPTS[:2], 3, [])] == [3, 3]
