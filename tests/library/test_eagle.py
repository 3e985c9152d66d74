"""The EAGLE draft (`generation.eagle`): fc + one decoder layer over (feature, next token), greedy
speculation equals plain greedy decoding, the sampled output follows the target (chi-square,
false-failure rate < 1e-4), the draft's cache after each pass equals a fresh cache built from the
target's features of the kept prefix, training teaches it, bad inputs are refused."""

import functools

import pytest
import torch
from cs336_inference.generation import generate, speculative_generate
from cs336_inference.generation.draft_heads import load_draft_heads, load_drafter, save_draft_heads
from cs336_inference.generation.draft_training import train_eagle
from cs336_inference.generation.eagle import EagleDraft, EagleDrafter, eagle_config
from cs336_inference.generation.speculative import SpeculativeDecoder
from test_medusa import lm_head_input, one_thread_only, toy_data
from test_speculative_decoding import _cache_tensors, sampled_law_p_value, tiny_pair


@functools.cache
def trained_toy():
    """The toy target, its data, and an EAGLE draft trained on it for a few seconds (test_eagle_tree too)."""
    target, data = toy_data()
    with one_thread_only():
        draft, history = train_eagle(target, data, steps=60, window=24, batch_size=4, lr=3e-3, log_every=59)
    return target, data, draft, history


@pytest.fixture(scope="module")
def toy():
    return trained_toy()


def test_a_short_training_run_teaches_the_draft(toy):
    history = toy[3]
    assert history["steps_run"] == 60
    assert history["accuracy"][-1] > history["accuracy"][0] + 0.2, history["accuracy"]


@torch.no_grad()
def test_the_draft_is_fc_then_one_block_over_features_and_next_embeddings(toy):
    target, _, draft, _ = toy
    seq = list(b"Once upon a time")
    h = lm_head_input(target, torch.tensor([seq]))
    feats, emb = h[:, :-1], target.token_embeddings(torch.tensor([seq[1:]]))             # h_t, embed(x_{t+1})
    got = draft(feats, emb)
    # reference: the same block run token by token through a cache (causal by construction)
    cache = draft.new_cache(len(seq))
    steps = [draft(feats[:, i:i + 1], emb[:, i:i + 1], cache) for i in range(feats.shape[1])]
    torch.testing.assert_close(got, torch.cat(steps, 1), rtol=1e-4, atol=1e-4)
    x = draft.fc.weight @ torch.cat([feats[0, 0], emb[0, 0]]) + draft.fc.bias          # position 0 sees itself only
    block = draft.block
    a = block.attn.output_proj(block.attn.v_proj(block.ln1(x)).reshape(-1, block.attn.head_dim)
                               .repeat_interleave(target.config.num_heads // target.config.num_kv_heads, 0).reshape(-1))
    y = x + a
    torch.testing.assert_close(got[0, 0], y + block.ffn(block.ln2(y)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_output_equals_plain_greedy_decoding(toy, one_thread, gamma):
    target, _, draft, _ = toy
    accepted = 0
    for text in (b"Once upon a time, ", b"The river was "):
        prompt = list(text)
        want = generate(target, [prompt], 40).tokens[0]
        out = speculative_generate(target, EagleDrafter(target, draft), prompt, gamma, max_new_tokens=40)
        assert out.tokens == want
        accepted += sum(out.accepted)
    assert accepted > 0, "no EAGLE draft was ever accepted: the test did not exercise acceptance"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@torch.inference_mode()
def test_draft_cache_after_each_pass_equals_a_fresh_one_on_the_kept_prefix(toy, one_thread, temperature):
    target, _, draft, _ = toy
    dec = SpeculativeDecoder(target, EagleDrafter(target, draft), list(b"By dawn the price of "), 4, temperature,
                             max_new_tokens=48, generator=torch.Generator().manual_seed(1))
    rejections = 0
    while not dec.finished:
        dec.step()
        rejections += dec.result.accepted[-1] < dec.result.proposed[-1]
        seq, drafter = dec.sequence, dec.drafter
        n = drafter.cache.length
        assert n == drafter.true_len and n <= len(seq) - 2     # only positions computed from true features
        h = lm_head_input(target, torch.tensor([seq]))                # the target's features after its final norm
        fresh = draft.new_cache(drafter.cache.max_seq_len)
        draft(h[:, :n], target.token_embeddings(torch.tensor([seq[1:n + 1]])), fresh)
        for got, want in zip(_cache_tensors(drafter.cache, n), _cache_tensors(fresh, n), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.cat(drafter.pending), h[0, n:len(seq) - 1], rtol=1e-4, atol=1e-4)
    assert rejections > 0, "no draft was ever rejected: this test did not exercise rollback"


def test_sampled_tokens_follow_the_target_chi_square(one_thread):
    target, _ = tiny_pair("bad")
    torch.manual_seed(4)
    draft = EagleDraft(eagle_config(target.config))
    p = sampled_law_p_value(target, EagleDrafter(target, draft), [0, 1, 2], k=3, gamma=2, runs=1000, seed=6,
                            temperature=1.0)
    assert p > 1e-4, f"EAGLE-drafted samples do not follow the target (p = {p:.2e})"


def test_save_and_load_round_trip(toy, tmp_path):
    target, _, draft, _ = toy
    save_draft_heads(tmp_path / "eagle.pt", draft)
    loaded = load_draft_heads(target, tmp_path / "eagle.pt")
    assert isinstance(loaded, EagleDraft) and loaded.config == draft.config
    f, e = torch.randn(1, 5, target.config.d_model), torch.randn(1, 5, target.config.d_model)
    torch.testing.assert_close(loaded(f, e), draft(f, e), rtol=5e-2, atol=5e-2)   # stored in bf16
    assert isinstance(load_drafter(target, tmp_path / "eagle.pt"), EagleDrafter)


def test_a_draft_saved_for_features_before_the_norm_is_refused(toy, tmp_path):
    """Drafts of earlier versions read the target's last-block output before the final norm; run on the
    normed features they would draft nonsense, so loading one says what it is instead."""
    target, _, draft, _ = toy
    save_draft_heads(tmp_path / "eagle.pt", draft)
    blob = torch.load(tmp_path / "eagle.pt", weights_only=True)
    del blob["features"]                                   # as those versions wrote it
    torch.save(blob, tmp_path / "old.pt")
    with pytest.raises(ValueError, match="before the final norm.*train it again"):
        load_draft_heads(target, tmp_path / "old.pt")


def test_bad_inputs_are_refused(toy):
    target, data, draft, _ = toy
    with pytest.raises(ValueError, match="num_layers must be 1"):
        EagleDraft(target.config)
    with pytest.raises(ValueError, match="d_model"):
        EagleDrafter(target, EagleDraft(eagle_config(target.config).replace(d_model=96)))
    with pytest.raises(TypeError, match="draft"):
        EagleDrafter(target, torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="window"):
        train_eagle(target, data, steps=1, window=10_000)


@pytest.mark.slow
@pytest.mark.parametrize("name, gamma", [("medusa-smollm2", 4), ("eagle-smollm2", 5)])
@torch.inference_mode()
def test_shipped_smollm2_drafts_keep_greedy_output_identical(name, gamma):
    """The shipped heads on SmolLM2 (as `bench speculative` runs them): the same tokens as plain greedy
    decoding, and they do draft tokens the target accepts, from the rows of the ids they trained on."""
    from cs336_inference.generation.draft_heads import ASSETS, SHIPPED
    from cs336_inference.model import load_pretrained, load_tokenizer
    from cs336_inference.model.real_models import real_model_missing

    if missing := real_model_missing("smollm2-135m"):
        pytest.skip(missing)
    if not (ASSETS / SHIPPED[name]).exists():
        pytest.skip(f"{SHIPPED[name]} is not installed")
    target, tok = load_pretrained("smollm2-135m"), load_tokenizer("smollm2-135m")
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a short story about a "
                                                  "lighthouse keeper who finds a message in a bottle."}]))
    want = generate(target, [prompt], 40, stop_tokens=tok.stop_ids).tokens[0]
    drafter = load_drafter(target, name)
    assert drafter.head.reads_rows and len(drafter.head.ids) < target.config.vocab_size // 5   # `draft_vocab`
    out = speculative_generate(target, drafter, prompt, gamma, max_new_tokens=40, stop_tokens=tok.stop_ids)
    assert out.tokens == want
    assert sum(out.accepted) > 0, f"{name} drafted nothing the target accepted"
