"""Medusa heads (`generation.medusa`) and their training (`generation.draft_training`): the heads are the
residual blocks of the paper on the target's own features, greedy speculation with them equals plain
greedy decoding, the sampled output follows the target (chi-square, false-failure rate < 1e-4), a short
training run teaches them something, save/load round-trips, bad inputs are refused."""

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from cs336_inference.data.corpus import corpus_documents
from cs336_inference.generation import generate, speculative_generate
from cs336_inference.generation.draft_heads import load_draft_heads, load_drafter, save_draft_heads
from cs336_inference.generation.draft_training import self_distillation_data, train_medusa
from cs336_inference.generation import medusa_tree
from cs336_inference.generation.medusa import MedusaDrafter, MedusaHeads
from cs336_inference.generation.medusa_tree import check_tree, compact_cache, medusa_tree_generate, tree_forward
from cs336_inference.model import load_pretrained
from cs336_inference.workshop.benchmarks.speculative_heads import split
from test_speculative_decoding import sampled_law_p_value, tiny_pair


@functools.cache
def toy_data():
    """The shipped toy target and a little self-distillation data (greedy continuations of corpus openings)."""
    target = load_pretrained("target")
    prompts = [list(d[:32].encode()) for d in corpus_documents("train")[:6]]
    with one_thread_only():
        return target, self_distillation_data(target, prompts, 40, batch_size=6)


@contextlib.contextmanager
def one_thread_only():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def toy():
    """The toy target, its data, and heads trained on it for a few seconds."""
    torch.manual_seed(0)
    target, data = toy_data()
    with one_thread_only():
        heads, history = train_medusa(target, data, num_heads=3, steps=60, batch_size=64, lr=3e-3, log_every=59)
    return target, data, heads, history


def ln_final_input(target, ids):
    """The last block's output, caught on its way into the final norm (independent of return_hidden)."""
    seen = []
    handle = target.ln_final.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    try:
        logits = target(ids)
    finally:
        handle.remove()
    return logits, seen[0]


def lm_head_input(target, ids):
    """The final norm's output, caught on its way into the LM head: the features an EAGLE draft reads."""
    seen = []
    handle = target.ln_final.register_forward_hook(lambda mod, args, out: seen.append(out))
    try:
        target(ids)
    finally:
        handle.remove()
    return seen[0]


@torch.no_grad()
def test_return_hidden_is_the_final_norms_input_and_logits_are_unchanged(toy):
    target = toy[0]
    ids = torch.tensor([list(b"The miller said ")])
    logits, hidden = target(ids, return_hidden=True)
    want_logits, want_hidden = ln_final_input(target, ids)
    torch.testing.assert_close(logits, want_logits)
    torch.testing.assert_close(hidden, want_hidden)
    torch.testing.assert_close(target.lm_head(target.ln_final(hidden)), logits)


def restricted(logits, vocab):
    """logits (..., V) with -inf off the ids a draft ranks (`vocab`; None: every id kept)."""
    if vocab is None:
        return logits
    outside = torch.ones(logits.shape[-1], dtype=torch.bool)
    outside[vocab] = False
    return logits.masked_fill(outside.to(logits.device), float("-inf"))


@torch.no_grad()
def test_heads_are_residual_silu_blocks_through_the_frozen_lm_head(toy):
    target, _, heads, _ = toy
    ids = torch.tensor([list(b"Once upon a time")])
    _, f = ln_final_input(target, ids)
    drafter = MedusaDrafter(target, heads)
    drafter.observe(f[0])
    h = target.ln_final(f[0, -1])                                                       # (D,)
    want = torch.stack([target.lm_head(h + F.silu(h @ w.weight.T)) for w in heads.proj])
    assert 0 < len(heads.vocab) < target.config.vocab_size   # trained heads rank the ids their data used, only those
    torch.testing.assert_close(drafter.head_logits(3), restricted(want, heads.vocab), rtol=1e-5, atol=1e-5)


def test_untrained_heads_are_the_identity():
    heads = MedusaHeads(8, 2)
    x = torch.randn(5, 8)
    torch.testing.assert_close(heads(x), x[:, None].expand(5, 2, 8))


def test_a_short_training_run_teaches_the_heads(toy):
    _, _, _, history = toy
    first, last = history["accuracy"][0], history["accuracy"][-1]
    assert history["steps_run"] == 60
    assert all(b > a + 0.1 for a, b in zip(first, last)), f"top-1 accuracy per head did not rise: {first} -> {last}"


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_greedy_output_equals_plain_greedy_decoding(toy, one_thread, gamma):
    target, _, heads, _ = toy
    accepted = 0
    for text in (b"Once upon a time, ", b"The river was "):
        prompt = list(text)
        want = generate(target, [prompt], 40).tokens[0]
        out = speculative_generate(target, MedusaDrafter(target, heads), prompt, gamma, max_new_tokens=40)
        assert out.tokens == want
        assert max(out.proposed) <= min(gamma, 3)   # never more drafts than heads
        accepted += sum(out.accepted)
    assert accepted > 0, "no Medusa draft was ever accepted: the test did not exercise acceptance"


def test_sampled_tokens_follow_the_target_chi_square(one_thread):
    # The tiny V = 4 target of test_speculative_decoding, random heads (their guesses ignore each other):
    # the joint law of 3 tokens over 1000 runs; false-failure rate 1e-4.
    target, _ = tiny_pair("bad")
    torch.manual_seed(3)
    heads = MedusaHeads(target.config.d_model, 2)
    with torch.no_grad():
        for w in heads.proj:
            w.weight.normal_(0, 1.0)
    p = sampled_law_p_value(target, MedusaDrafter(target, heads), [0, 1, 2], k=3, gamma=2, runs=1000, seed=6,
                            temperature=1.0)
    assert p > 1e-4, f"Medusa-drafted samples do not follow the target (p = {p:.2e})"


def test_save_and_load_round_trip(toy, tmp_path):
    target, _, heads, _ = toy
    path = tmp_path / "heads.pt"
    save_draft_heads(path, heads, meta=dict(note="test"))
    loaded = load_draft_heads(target, path)
    assert isinstance(loaded, MedusaHeads) and loaded.num_heads == 3 and loaded.meta == dict(note="test")
    x = torch.randn(4, target.config.d_model)
    torch.testing.assert_close(loaded(x), heads(x), rtol=1e-2, atol=2e-2)   # stored in bf16
    assert isinstance(load_drafter(target, path), MedusaDrafter)


def test_bad_inputs_are_refused(toy, tmp_path):
    target = toy[0]
    with pytest.raises(ValueError, match="num_heads"):
        MedusaHeads(target.config.d_model, 0)
    with pytest.raises(ValueError, match="d_model"):
        MedusaDrafter(target, MedusaHeads(target.config.d_model + 1, 2))
    with pytest.raises(ValueError, match="unknown draft heads"):
        load_draft_heads(target, "no-such-heads")
    with pytest.raises(TypeError, match="heads"):
        MedusaDrafter(target, torch.nn.Linear(2, 2))
    torch.save({"something": 1}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="save_draft_heads"):
        load_draft_heads(target, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="num_heads"):
        train_medusa(target, toy[1], num_heads=0)
    other = load_pretrained("target")   # the same weights, another model object: its features are not handed over
    with pytest.raises(ValueError, match="another model's features"):
        speculative_generate(other, MedusaDrafter(target, toy[2]), list(b"Hi"), 2, max_new_tokens=4)


# --- tree attention (`generation.medusa_tree`) ---------------------------------------------------------

TREE = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))


@torch.inference_mode()
def test_tree_forward_equals_each_branch_run_alone(toy, one_thread):
    target = toy[0]
    prompt = list(b"The river was ")
    paths = check_tree(TREE, 3)
    parents = [0 if len(p) == 1 else 1 + paths.index(p[:-1]) for p in paths]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 257, (len(paths) + 1,), generator=g)                      # root + nodes
    depths = torch.tensor([0] + [len(p) for p in paths])
    cache = target.new_cache(1, 64)
    target(torch.tensor([prompt]), cache=cache)
    logits, hidden = tree_forward(target, cache, tokens, parents, depths)
    assert cache.length == len(prompt) + len(tokens)
    for i, path in enumerate(((),) + paths):
        # the naive reference: this node's branch (root, its ancestors, itself) after the prompt, no tree
        branch = [int(tokens[0])] + [int(tokens[1 + paths.index(path[:d])]) for d in range(1, len(path) + 1)]
        want = target(torch.tensor([prompt + branch]))[0, -1]
        torch.testing.assert_close(logits[i], want, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_compacted_cache_equals_a_fresh_cache_on_the_kept_branch(toy, one_thread):
    target = toy[0]
    prompt, paths = list(b"Once upon "), check_tree(TREE, 3)
    parents = [0 if len(p) == 1 else 1 + paths.index(p[:-1]) for p in paths]
    tokens = torch.randint(0, 257, (len(paths) + 1,), generator=torch.Generator().manual_seed(1))
    cache = target.new_cache(1, 64)
    target(torch.tensor([prompt]), cache=cache)
    tree_forward(target, cache, tokens, parents, torch.tensor([0] + [len(p) for p in paths]))
    branch = [0, 1 + paths.index((0,)), 1 + paths.index((0, 1))]                      # root -> (0,) -> (0, 1)
    compact_cache(cache, len(prompt), branch)
    fresh = target.new_cache(1, 64)
    target(torch.tensor([prompt + tokens[branch].tolist()]), cache=fresh)
    assert cache.length == fresh.length == len(prompt) + 3
    for got, want in zip(cache.unique_layers(), fresh.unique_layers()):
        for a, b in zip(got.read(cache.length), want.read(cache.length)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_tree_decoding_greedy_equals_plain_greedy_decoding(toy, one_thread):
    target, _, heads, _ = toy
    accepted = 0
    for text in (b"Once upon a time, ", b"The river was "):
        prompt = list(text)
        out = medusa_tree_generate(target, heads, prompt, 40, tree=TREE)
        assert out.tokens == generate(target, [prompt], 40).tokens[0]
        accepted += sum(out.accepted)
    assert accepted > 0


def test_typical_acceptance_runs_and_says_it_is_not_exact(toy, one_thread):
    target, _, heads, _ = toy
    out = medusa_tree_generate(target, heads, list(b"Once "), 24, tree=TREE, rule="typical", temperature=0.7,
                               generator=torch.Generator().manual_seed(0))
    assert len(out.tokens) == 24 and all(0 <= t < 257 for t in out.tokens)
    assert "NOT EXACT" in medusa_tree.__doc__ and "NOT exact" in medusa_tree_generate.__doc__


def test_bad_trees_are_refused(toy):
    target, _, heads, _ = toy
    for tree, match in ((((0, 1),), "parent"), (((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)), "only 3 heads"),
                        ((), "non-empty"), (((0,), (0,)), "repeated"), (((-1,),), "ranks")):
        with pytest.raises(ValueError, match=match):
            medusa_tree_generate(target, heads, list(b"Hi"), 4, tree=tree)
    with pytest.raises(ValueError, match="rule"):
        medusa_tree_generate(target, heads, list(b"Hi"), 4, rule="fast")


def test_early_stopping_keeps_the_heads_that_were_best_on_held_out_sequences(toy, one_thread):
    target, data = toy[0], toy[1]
    train, val = split(data, every=3)
    heads, history = train_medusa(target, train, num_heads=2, steps=30, batch_size=32, lr=3e-3, log_every=10,
                                  val=val)
    scores = history["val_accuracy"]
    assert history["best_val_accuracy"] == max(scores)
    assert history["best_step"] == history["step"][scores.index(max(scores))]
    # the kept heads score that accuracy again (recomputed here from their logits)
    K, used = 2, torch.cat([train.vocabulary(), val.vocabulary()]).unique()
    right = total = 0
    with torch.no_grad():
        for f, a in zip(val.features, val.labels):
            z = heads(target.ln_final(f[:len(f) - K]))                                    # (T-K, K, D)
            guess = used[(z @ target.lm_head.weight[used].T).argmax(-1)]
            want = torch.stack([a[k:len(a) - K + k] for k in range(1, K + 1)], -1)
            right, total = right + int((guess == want).sum()), total + want.numel()
    assert right / total == pytest.approx(max(scores), abs=1e-6)
