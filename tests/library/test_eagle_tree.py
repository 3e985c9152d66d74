"""EAGLE-2's draft tree (`generation.eagle_tree`): each tree node's draft feature equals the draft run
along that node's path alone, the nodes sent to the target form a tree of the best-scored paths plus
the copied branch, greedy output equals plain greedy decoding, a one-wide tree is the chain, the
several-candidate rule and sampled trees follow the target (chi-square, false-failure rate 1e-4 each),
bad inputs are refused without touching the draft's cache."""

import pytest
import torch
from cs336_inference.generation import eagle_tree, generate, speculative_generate
from cs336_inference.generation.eagle import EagleDraft, EagleDrafter, eagle_config
from cs336_inference.generation.eagle_tree import Node, eagle_tree_generate, grow_tree, select_nodes
from cs336_inference.generation.speculative_rule import accept_among_candidates
from test_eagle import trained_toy
from test_medusa import lm_head_input, ln_final_input, restricted
from test_speculative_decoding import _cache_tensors, target_joint_law, tiny_pair
from test_speculative_rule import chi_square_p_value

PROMPTS = (b"Once upon a time, ", b"The river was ", b"the the the the the ")


@pytest.fixture(scope="module")
def toy():
    return trained_toy()


@torch.inference_mode()
def test_each_nodes_feature_equals_the_draft_run_along_its_path_alone(toy, one_thread):
    target, _, draft, _ = toy
    seq = list(b"By dawn the price of bread")
    _, f = ln_final_input(target, torch.tensor([seq]))                                 # the target's features
    h = lm_head_input(target, torch.tensor([seq]))                                     # the same after the norm
    drafter = EagleDrafter(target, draft)
    drafter.start(seq, 64, max_rollback=32)
    drafter.observe(f[0, :-1])                       # positions 0..len-2 final; seq[-1] is the last emitted token
    nodes = grow_tree(drafter, seq, depth=4, top_k=3)
    expanded = [n for n in nodes if n.feature is not None]
    assert len(expanded) == 3 * 3 and max(n.depth for n in nodes) == 4
    for node in expanded:
        path = [node]
        while path[-1].parent >= 0:
            path.append(nodes[path[-1].parent])
        path.reverse()
        fresh = draft.new_cache(64)                  # reference: the plain causal draft, true context then the path
        out = draft(h[:, :len(seq) - 1], target.token_embeddings(torch.tensor([seq[1:]])), fresh)[0, -1]
        for step in path:
            out = draft(out[None, None], target.token_embeddings(torch.tensor([[step.token]])), fresh)[0, -1]
        torch.testing.assert_close(node.feature, out, rtol=1e-4, atol=1e-4)
    for d in range(1, 4):                            # each depth expands its best-scored top_k
        level = sorted((n for n in nodes if n.depth == d), key=lambda n: -n.score)
        assert [n.feature is not None for n in level] == [True] * 3 + [False] * (len(level) - 3)
    for node in nodes:                               # scores: the draft's log-probabilities summed along the path
        if node.parent >= 0:                         # (over the ids the trained draft ranks: its data's)
            parent = nodes[node.parent]
            logp = torch.log_softmax(restricted(target.lm_head(parent.feature).float(), draft.vocab), -1)[node.token]
            assert node.score == pytest.approx(parent.score + float(logp), abs=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_draft_reads_the_kept_branchs_target_features_after_each_pass(toy, one_thread, monkeypatch, temperature):
    """Before every tree, the draft's cache holds exactly the true positions, equal to a fresh cache fed the
    target's features of the sequence so far, and its pending features are the target's for the rest."""
    target, _, draft, _ = toy
    real, checked = eagle_tree.grow_tree, []

    def checking(drafter, sequence, depth, top_k, draws):
        n = drafter.cache.length
        assert n == drafter.true_len
        h = lm_head_input(target, torch.tensor([sequence]))
        fresh = draft.new_cache(drafter.cache.max_seq_len)
        if n:   # nothing is cached before the first tree
            draft(h[:, :n], target.token_embeddings(torch.tensor([sequence[1:n + 1]])), fresh)
        for got, want in zip(_cache_tensors(drafter.cache, n), _cache_tensors(fresh, n), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(torch.cat(drafter.pending), h[0, n:len(sequence) - 1], rtol=1e-4, atol=1e-4)
        checked.append(n)
        return real(drafter, sequence, depth, top_k, draws)

    monkeypatch.setattr(eagle_tree, "grow_tree", checking)
    out = eagle_tree_generate(target, draft, list(b"By dawn the price of "), 40, depth=4, top_k=3, budget=8,
                              temperature=temperature, generator=torch.Generator().manual_seed(3))
    assert len(checked) == len(out.accepted) > 1 and sum(out.accepted) > 0


def test_select_nodes_keeps_the_best_paths_and_adds_the_copy():
    nodes = [Node(10, -1, 1, -0.1), Node(11, -1, 1, -2.0), Node(12, 0, 2, -0.5), Node(13, 0, 2, -3.0),
             Node(14, 2, 3, -0.9)]
    assert select_nodes(list(nodes), 3) == [0, 2, 4]
    assert select_nodes(list(nodes), 4) == [0, 1, 2, 4]
    grown = list(nodes)
    chosen = select_nodes(grown, 2, copy=[10, 13, 7])    # shares node 0, then node 3, then a new node
    assert chosen == [0, 2, 3, 5] and (grown[5].token, grown[5].parent, grown[5].depth) == (7, 3, 3)
    for i in chosen:                                     # closed under prefixes
        assert grown[i].parent < 0 or grown[i].parent in chosen


@pytest.mark.parametrize("depth, top_k, budget, lookup_tokens", [(3, 2, 4, 0), (5, 4, 16, 0), (4, 3, 8, 6)])
def test_greedy_output_equals_plain_greedy_decoding(toy, one_thread, depth, top_k, budget, lookup_tokens):
    target, _, draft, _ = toy
    accepted = 0
    for text in PROMPTS:
        prompt = list(text)
        out = eagle_tree_generate(target, draft, prompt, 40, depth=depth, top_k=top_k, budget=budget,
                                  lookup_tokens=lookup_tokens)
        assert out.tokens == generate(target, [prompt], 40).tokens[0]
        assert all(k <= g for g, k in zip(out.proposed, out.accepted))
        accepted += sum(out.accepted)
    assert accepted > 0, "no tree node was ever accepted: the test did not exercise acceptance"


def test_a_one_wide_tree_is_the_chain(toy, one_thread):
    """top_k 1 and budget = depth verify exactly the chain's drafts: the same tokens kept in every pass."""
    target, _, draft, _ = toy
    for text in PROMPTS:
        prompt = list(text)
        tree = eagle_tree_generate(target, draft, prompt, 40, depth=4, top_k=1, budget=4)
        chain = speculative_generate(target, EagleDrafter(target, draft), prompt, 4, max_new_tokens=40)
        assert tree.tokens == chain.tokens
        full = [i for i, g in enumerate(chain.proposed) if g == 4]
        assert [tree.accepted[i] for i in full] == [chain.accepted[i] for i in full]


def test_a_wider_tree_keeps_at_least_as_many_tokens_per_pass_on_the_toy(toy, one_thread):
    target, _, draft, _ = toy
    narrow = wide = 0.0
    for text in PROMPTS:
        narrow += eagle_tree_generate(target, draft, list(text), 40, depth=4, top_k=1, budget=4).mean_tokens_per_pass
        wide += eagle_tree_generate(target, draft, list(text), 40, depth=4, top_k=4, budget=16).mean_tokens_per_pass
    assert wide >= narrow


def test_stop_tokens_and_the_length_are_respected(toy, one_thread):
    target, _, draft, _ = toy
    prompt = list(b"Once upon a time, ")
    want = generate(target, [prompt], 40).tokens[0]
    stop = want[7]
    out = eagle_tree_generate(target, draft, prompt, 40, stop_tokens=[stop])
    assert out.tokens == want[:want.index(stop) + 1]
    for n in (0, 1, 3):
        assert eagle_tree_generate(target, draft, prompt, n, depth=5).tokens == want[:n]


def test_bad_inputs_are_refused_and_leave_the_cache_alone(toy):
    target, _, draft, _ = toy
    prompt = list(b"abc")
    for kwargs, name in (({"depth": 0}, "depth"), ({"top_k": 0}, "top_k"), ({"budget": 0}, "budget"),
                         ({"lookup_tokens": -1}, "lookup_tokens"), ({"max_new_tokens": -2}, "max_new_tokens")):
        with pytest.raises(ValueError, match=name):
            eagle_tree_generate(target, draft, prompt, **kwargs)
    with pytest.raises(TypeError, match="draft"):
        eagle_tree_generate(target, torch.nn.Linear(2, 2), prompt)
    with pytest.raises(ValueError, match="temperature"):
        eagle_tree_generate(target, draft, prompt, temperature=-1.0)
    with pytest.raises(ValueError, match="lookup_tokens=4 needs temperature 0"):
        eagle_tree_generate(target, draft, prompt, temperature=0.7, lookup_tokens=4)
    cache = draft.new_cache(16)
    d = target.config.d_model
    with pytest.raises(ValueError, match="go together"):
        draft(torch.zeros(1, 2, d), torch.zeros(1, 2, d), cache, positions=torch.arange(2))
    with pytest.raises(ValueError, match="visible"):
        draft(torch.zeros(1, 2, d), torch.zeros(1, 2, d), cache, positions=torch.arange(2),
              visible=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="cache="):
        draft(torch.zeros(1, 2, d), torch.zeros(1, 2, d), positions=torch.arange(2),
              visible=torch.ones(2, 2, dtype=torch.bool))
    assert cache.length == 0


@pytest.mark.parametrize("draft_probs", [[0.4, 0.3, 0.2, 0.1, 0.0], [0.05, 0.05, 0.1, 0.1, 0.7], [0.5, 0.5, 0, 0, 0]])
def test_the_several_candidate_rule_samples_the_target_chi_square(draft_probs):
    """Candidates drawn without replacement by torch.multinomial (not the library's draws); three of them,
    and for the last draft only two can be drawn. The output follows the target (false-failure rate 1e-4)."""
    p = torch.tensor(draft_probs, dtype=torch.float64)
    q = torch.tensor([0.1, 0.2, 0.3, 0.15, 0.25], dtype=torch.float64)
    g, runs, counts = torch.Generator().manual_seed(11), 6000, [0] * 5
    accepted = 0
    for _ in range(runs):
        candidates = torch.multinomial(p, min(3, int((p > 0).sum())), replacement=False, generator=g).tolist()
        index, token = accept_among_candidates(p, q, candidates, g)
        assert index is None or candidates[index] == token
        accepted += index is not None
        counts[token] += 1
    assert chi_square_p_value(counts, [runs * float(x) for x in q]) > 1e-4, counts
    assert 0 < accepted < runs


def test_the_several_candidate_rule_accepts_the_first_candidate_of_a_draft_equal_to_the_target():
    p = torch.tensor([0.2, 0.5, 0.3])
    g = torch.Generator().manual_seed(0)
    assert all(accept_among_candidates(p, p, [t, (t + 1) % 3], g) == (0, t) for t in range(3) for _ in range(20))


def test_the_several_candidate_rule_refuses_bad_input():
    p, q, g = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.2, 0.3, 0.5]), torch.Generator().manual_seed(0)
    with pytest.raises(TypeError, match="p_draft"):
        accept_among_candidates(p[None], q, [0], g)
    with pytest.raises(ValueError, match="one vocabulary"):
        accept_among_candidates(p, torch.tensor([0.5, 0.5]), [0], g)
    with pytest.raises(ValueError, match="candidates"):
        accept_among_candidates(p, q, [0, 3], g)
    with pytest.raises(ValueError, match="candidates"):
        accept_among_candidates(p, q, [1, 1], g)
    with pytest.raises(TypeError, match="candidates"):
        accept_among_candidates(p, q, torch.tensor([0]), g)
    with pytest.raises(ValueError, match="q_target"):
        accept_among_candidates(p, torch.tensor([2.0, -1.0, 0.0]), [0], g)


@pytest.mark.parametrize("depth, top_k, budget, temperature", [(2, 2, 5, 2.0),
                                                             pytest.param(3, 3, 7, 1.0, marks=pytest.mark.slow)])
def test_sampled_tree_follows_the_target_chi_square(one_thread, depth, top_k, budget, temperature):
    """A random EAGLE draft on the tiny 4-token target: the first 3 sampled tokens follow the target's
    joint law from full forwards (false-failure rate 1e-4 per case; temperature 2 flattens both models,
    so drawing the children and taking the draft's top guesses differ)."""
    target, _ = tiny_pair("bad")
    torch.manual_seed(4)
    draft = EagleDraft(eagle_config(target.config))
    prompt, runs = [0, 1, 2], 1000
    law = target_joint_law(target, prompt, 3, temperature)
    counts = dict.fromkeys(law, 0)
    g, accepted = torch.Generator().manual_seed(6), 0
    for _ in range(runs):
        out = eagle_tree_generate(target, draft, prompt, 3, depth=depth, top_k=top_k, budget=budget,
                                  temperature=temperature, generator=g)
        counts[tuple(out.tokens)] += 1
        accepted += sum(out.accepted)
    assert chi_square_p_value(list(counts.values()), [runs * law[c] for c in counts]) > 1e-4
    assert accepted > 0, "no drafted token was ever accepted: the test did not exercise acceptance"
