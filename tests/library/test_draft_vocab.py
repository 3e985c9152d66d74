"""A draft's vocabulary (`generation.draft_vocab`): the restricted head is the LM head's rows on the
draft's ids and -inf elsewhere (a plain matmul written here is the reference), a quantized-style head
gives the same logits; with a draft that can propose only 2 of 4 ids the sampled output still follows
the target (chi-square, false-failure rate 1e-4) and greedy output equals plain greedy; training sets
the vocabulary, save/load keeps it, bad ids are refused with the argument named."""

import copy

import pytest
import torch
import torch.nn as nn
from cs336_inference.generation import generate, speculative_generate
from cs336_inference.generation.draft_heads import load_draft_heads, save_draft_heads
from cs336_inference.generation.draft_vocab import DraftHead, check_vocab, set_vocab
from cs336_inference.generation.eagle import EagleDraft, EagleDrafter, eagle_config
from cs336_inference.generation.medusa import MedusaDrafter, MedusaHeads
from cs336_inference.quantization.core import quantize_tensor
from cs336_inference.quantization.linear import QuantizedLinear
from cs336_inference.quantization.model import RescoredHead, quantize_model
from test_eagle import trained_toy
from test_medusa import restricted
from test_speculative_decoding import sampled_law_p_value, target_joint_law, tiny_pair

MINUS_INF = float("-inf")


class WrappedHead(nn.Module):
    """An LM head that is not a plain nn.Linear (as a quantized one is not)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x)


def draft_module(kind: str, target, vocab):
    """A seeded random EAGLE draft or two Medusa heads, ranking the ids `vocab` only."""
    torch.manual_seed(4)
    if kind == "eagle":
        module = EagleDraft(eagle_config(target.config))
    else:
        module = MedusaHeads(target.config.d_model, 2)
        with torch.no_grad():
            for w in module.proj:
                w.weight.normal_(0, 0.5)
    set_vocab(module, vocab, target.config.vocab_size)
    return module


def drafter(kind: str, target, vocab):
    return (EagleDrafter if kind == "eagle" else MedusaDrafter)(target, draft_module(kind, target, vocab))


@torch.no_grad()
def test_restricted_logits_are_the_heads_rows_and_minus_inf_elsewhere():
    target, _ = tiny_pair("good")
    z = torch.randn(3, 2, target.config.d_model)
    full = z @ target.lm_head.weight.T                                                  # (3, 2, V)
    got = DraftHead(target, torch.tensor([3, 0]))(z)
    assert got.shape == full.shape and bool((got[..., [1, 2]] == MINUS_INF).all())
    torch.testing.assert_close(got, restricted(full, [0, 3]))
    torch.testing.assert_close(DraftHead(target)(z), full)                              # no vocabulary: every row
    wrapped = copy.deepcopy(target)
    wrapped.lm_head = WrappedHead(wrapped.lm_head)
    with pytest.warns(UserWarning, match="cannot give its rows.*computes all 4 logits"):
        head = DraftHead(wrapped, torch.tensor([0, 3]))                                 # announced, not silent
    assert not head.reads_rows
    torch.testing.assert_close(head(z), got)


@pytest.mark.parametrize("kind", ["int8", "rescored", "input_scale"])
@torch.no_grad()
def test_a_quantized_heads_kept_rows_are_read_dequantized(kind):
    """The fast path's LM head is int8 codes (a RescoredHead over a QuantizedLinear): the draft reads the kept
    rows dequantized, and its logits there equal the quantized head's own (bf16 kernel aside: reference kernel);
    AWQ's input scales divide the rows' columns."""
    target, _ = tiny_pair("good")
    q = quantize_model(target, "rtn", bits=8, group_size=8, quantize_lm_head=True, kernel="reference")
    if kind == "rescored":
        q.lm_head = RescoredHead(q.lm_head)
    if kind == "input_scale":
        qt = quantize_tensor(target.lm_head.weight.detach(), 8, granularity="group", group_size=8)
        q.lm_head = QuantizedLinear(qt, input_scale=torch.rand(target.config.d_model) + 0.5, kernel="reference")
    z = torch.randn(5, target.config.d_model)
    head = DraftHead(q, torch.tensor([1, 2]))
    assert head.reads_rows
    got = head(z)
    torch.testing.assert_close(got[:, [1, 2]], q.lm_head(z)[:, [1, 2]], rtol=1e-5, atol=1e-5)
    assert bool((got[:, [0, 3]] == MINUS_INF).all())


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_sampled_tokens_follow_the_target_when_the_draft_can_propose_two_of_four_ids(kind, one_thread):
    target, _ = tiny_pair("good")
    keep = torch.tensor([0, 1])
    law = target_joint_law(target, [0, 1, 2], 3)
    outside = sum(p for cell, p in law.items() if any(t >= 2 for t in cell))
    assert outside > 0.3, "the target must often want ids the draft cannot propose, or this proves nothing"
    d = drafter(kind, target, keep)
    proposals, original = [], d.propose

    def recording(*args, **kwargs):
        tokens, probs = original(*args, **kwargs)
        proposals.extend(tokens)
        assert not tokens or bool((probs[:, 2:] == 0).all())                            # q is zero off its ids
        return tokens, probs
    d.propose = recording
    p = sampled_law_p_value(target, d, [0, 1, 2], k=3, gamma=2, runs=1000, seed=6, temperature=1.0)
    assert proposals and set(proposals) <= {0, 1}
    assert p > 1e-4, f"samples drafted from a reduced vocabulary do not follow the target (p = {p:.2e})"


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_greedy_output_equals_plain_greedy_with_a_reduced_vocabulary(kind, one_thread):
    target, _ = tiny_pair("good")
    prompt = [0, 1, 2, 3, 1]
    want = generate(target, [prompt], 10).tokens[0]
    assert any(t >= 2 for t in want)                                                   # ids the draft cannot guess
    assert speculative_generate(target, drafter(kind, target, torch.tensor([0, 1])), prompt, 3,
                                max_new_tokens=10).tokens == want


@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_save_and_load_keep_the_vocabulary(kind, tmp_path):
    target, _ = tiny_pair("good")
    module = draft_module(kind, target, torch.tensor([3, 1]))
    save_draft_heads(tmp_path / "d.pt", module)
    assert load_draft_heads(target, tmp_path / "d.pt").vocab.tolist() == [1, 3]
    module.vocab = None
    save_draft_heads(tmp_path / "all.pt", module)
    assert load_draft_heads(target, tmp_path / "all.pt").vocab is None
    blob = torch.load(tmp_path / "d.pt", weights_only=True)
    blob["vocab"] = torch.tensor([1, 7], dtype=torch.int32)                             # id 7 >= vocab_size 4
    torch.save(blob, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match=r"bad\.pt: its vocab does not fit.*vocab_size=4"):
        load_draft_heads(target, tmp_path / "bad.pt")


def test_training_sets_the_vocabulary_to_the_ids_the_data_uses():
    _, data, draft, _ = trained_toy()
    assert draft.vocab.tolist() == sorted(set(torch.cat(data.labels).tolist()))


def test_bad_vocabularies_and_heads_are_refused():
    target, other = tiny_pair("good")
    with pytest.raises(TypeError, match="vocab must have an integer dtype"):
        check_vocab("vocab", torch.tensor([0.0, 1.0]), 4)
    with pytest.raises(ValueError, match=r"vocab must have shape \(T,\)"):
        check_vocab("vocab", torch.tensor([[0, 1]]), 4)
    with pytest.raises(ValueError, match=r"vocab must be in \[0, vocab_size=4\), got values in \[0, 4\]"):
        check_vocab("vocab", torch.tensor([0, 4]), 4)
    with pytest.raises(ValueError, match="vocab must hold distinct token ids, got 3 ids of which 1 repeat"):
        check_vocab("vocab", torch.tensor([2, 0, 2]), 4)
    with pytest.raises(ValueError, match="vocab must be non-empty"):
        check_vocab("vocab", torch.tensor([], dtype=torch.long), 4)
    heads = MedusaHeads(target.config.d_model, 2)
    with pytest.raises(ValueError, match="vocab must be in"):
        set_vocab(heads, torch.tensor([9]), 4)
    assert heads.vocab is None                                                          # a failed call changes nothing
    with pytest.raises(ValueError, match="head was built for another target"):
        MedusaDrafter(target, heads, DraftHead(other))
    with pytest.raises(TypeError, match="head must be a DraftHead"):
        EagleDrafter(target, EagleDraft(eagle_config(target.config)), target.lm_head)
