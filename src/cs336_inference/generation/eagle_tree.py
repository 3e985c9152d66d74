"""EAGLE-2's dynamic draft tree: many candidate continuations from one EAGLE draft, verified in one target pass.

The chain form (`eagle.EagleDrafter`) bets on the draft's best guess at every depth. A small draft's
second or fourth guess is often right where its best is wrong (SmolLM2's shipped draft, at depth 1 on
the bench's held-out answers: top-1 0.30, top-4 0.51), so EAGLE-2 (Li et al. 2024, arXiv:2406.16858)
grows a tree and lets the target pick the branch it agrees with:

  1. The draft reads the target's new features, as in the chain form, and predicts the next token:
     its top_k guesses become depth-1 nodes, each scored with its log-probability.
  2. At each further depth, the top_k best-scored nodes of the depth before are expanded in one draft
     forward: each attends to the true context and to its own ancestors only (a tree mask in the draft's
     cache, `EagleDraft.forward(positions=, visible=)`), and gets top_k children. A node's score is the
     sum of the draft's log-probabilities along its path: the draft's own guess of the chance that the
     target accepts the whole path.
  3. The `budget` best-scored nodes of every depth are verified by the target in one forward
     (`medusa_tree.tree_forward`). A child never scores above its parent, so they form a tree.

Optionally, prompt lookup's copy (the continuation after the last 2-4 tokens' earlier occurrence, up to
`lookup_tokens` long) joins as one more branch: where the answer copies its prompt, the copy is long
and right; elsewhere the draft's tree proposes (`lookup_then_draft` chooses one source per pass, this
verifies both at once).

Exactness: the greedy rule keeps a node iff it is the target's argmax after its parent, so the output
equals plain greedy decoding. Sampling from a tree exactly needs a rule over several candidates per
position (SpecInfer's recursive rejection); for sampled decoding use the chain with the accept/resample
rule. After each pass the draft's cache is cut back to its true positions (`EagleDrafter.rollback`)
and the kept branch's target features are what it reads next.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import _checks
from ..model.transformer import TransformerLM
from .eagle import EagleDraft, EagleDrafter
from .generate import stop_token_set
from .medusa_tree import compact_cache, emit_tokens, kept_branch, tree_forward
from .prompt_lookup import prompt_lookup_propose
from .speculative import SpeculativeResult


@dataclass
class Node:
    """One draft token in the tree. parent: index of its parent node, -1 for the root (the last emitted
    token); score: the sum of the draft's log-probabilities from the root; feature / slot: the draft's
    output after reading the node and its position in the draft's cache (set when the node is expanded)."""

    token: int
    parent: int
    depth: int
    score: float
    feature: torch.Tensor | None = None
    slot: int = -1


def _children(drafter: EagleDrafter, features: torch.Tensor, parents: list[int], nodes: list[Node],
              top_k: int, depth: int) -> list[int]:
    """features (n, D): the draft's outputs after each parent -> the indices of their top_k children each."""
    logp = torch.log_softmax(drafter.logits(features).float(), dim=-1)               # (n, V)
    scores, tokens = logp.topk(top_k, dim=-1)                                          # (n, top_k)
    added = []
    for parent, row_scores, row_tokens in zip(parents, scores.tolist(), tokens.tolist()):
        base = nodes[parent].score if parent >= 0 else 0.0
        for s, t in zip(row_scores, row_tokens):
            nodes.append(Node(t, parent, depth, base + s))
            added.append(len(nodes) - 1)
    return added


def grow_tree(drafter: EagleDrafter, sequence: list[int], depth: int, top_k: int) -> list[Node]:
    """Steps 1 and 2: read the target's pending features, then expand the best top_k nodes of each depth.

    Every node of depth d sits at draft position true_len + d - 1 (the chain's d-th draft step) and
    attends to the true positions and its ancestors' slots; the expanded nodes' slots stay in the
    draft's cache until `drafter.rollback`."""
    root_feature = drafter.read_pending(sequence)                                     # (D,)
    cache, true_len = drafter.cache, drafter.true_len
    nodes: list[Node] = []
    frontier = _children(drafter, root_feature[None], [-1], nodes, top_k, 1)
    for d in range(1, depth):
        frontier = sorted(frontier, key=lambda i: -nodes[i].score)[:top_k]
        start = cache.length
        visible = torch.zeros(len(frontier), start + len(frontier), dtype=torch.bool)
        visible[:, :true_len] = True
        for row, i in enumerate(frontier):
            visible[row, start + row] = True
            parent = nodes[i].parent
            while parent >= 0:
                visible[row, nodes[parent].slot] = True
                parent = nodes[parent].parent
        device, dtype = root_feature.device, drafter.draft.fc.weight.dtype
        inputs = torch.stack([root_feature if nodes[i].parent < 0 else nodes[nodes[i].parent].feature
                              for i in frontier]).to(dtype)                            # (n, D)
        tokens = torch.tensor([nodes[i].token for i in frontier], device=device)
        out = drafter.draft(inputs[None], drafter.target.token_embeddings(tokens)[None], cache,
                            positions=torch.full((len(frontier),), true_len + d - 1), visible=visible)[0]
        for row, i in enumerate(frontier):
            nodes[i].feature, nodes[i].slot = out[row], start + row
        frontier = _children(drafter, out, frontier, nodes, top_k, d + 1)
    drafter.forwards += depth   # the read and the depth - 1 expansions (each one batched draft forward)
    return nodes


def select_nodes(nodes: list[Node], budget: int, copy: list[int] = ()) -> list[int]:
    """Step 3: the `budget` best-scored nodes (ties: the shallower first, so a parent precedes its
    child), plus the branch spelling `copy` from the root (adding the nodes it lacks); in depth order."""
    chosen = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth))[:budget]
    parent = -1
    for token in copy:
        match = next((i for i, n in enumerate(nodes) if n.parent == parent and n.token == token), None)
        if match is None:
            nodes.append(Node(token, parent, nodes[parent].depth + 1 if parent >= 0 else 1, 0.0))
            match = len(nodes) - 1
        if match not in chosen:
            chosen.append(match)
        parent = match
    return sorted(chosen, key=lambda i: nodes[i].depth)


@torch.inference_mode()
def eagle_tree_generate(target: TransformerLM, draft: EagleDraft, prompt_ids, max_new_tokens: int = 64,
                        depth: int = 6, top_k: int = 8, budget: int = 32, lookup_tokens: int = 0,
                        stop_tokens=None) -> SpeculativeResult:
    """Greedy decoding with EAGLE-2's draft tree (see the module docstring); the output equals plain
    greedy decoding. depth: the tree's depth; top_k: the guesses kept per expanded node and the nodes
    expanded per depth; budget: the draft nodes the target verifies per pass; lookup_tokens: > 0 adds
    prompt lookup's copy of up to that many tokens as one more branch. Returns the tokens with
    `proposed` (the verified tree's depth) and `accepted` (the kept branch's length) per target pass."""
    _checks.instance("draft", draft, EagleDraft)
    for name, value in (("depth", depth), ("top_k", top_k), ("budget", budget)):
        _checks.integer(name, value, 1, None, allowed="an int >= 1")
    _checks.non_negative_int("lookup_tokens", lookup_tokens)
    _checks.non_negative_int("max_new_tokens", max_new_tokens)
    drafter = EagleDrafter(target, draft)                                             # checks the shared heads
    prompt = _checks.token_ids("prompt_ids", torch.as_tensor(prompt_ids), target.config.vocab_size, dims=(1,)).tolist()
    stop, device = stop_token_set(stop_tokens, target.config.vocab_size), target.device
    result = SpeculativeResult([], len(prompt), depth)
    if max_new_tokens == 0:
        return result
    room = len(prompt) + max_new_tokens
    cache = target.new_cache(1, room + budget + lookup_tokens + 1)
    drafter.start(prompt, room + (depth - 1) * top_k, max_rollback=(depth - 1) * top_k)
    logits, hidden = target(torch.tensor([prompt], device=device), cache=cache, return_hidden=True)
    drafter.observe(hidden[0])                                                        # (P, D)
    seq = prompt + [int(logits[0, -1].argmax())]
    result.tokens.append(seq[-1])
    while len(result.tokens) < max_new_tokens and seq[-1] not in stop:
        nodes = grow_tree(drafter, seq, depth, top_k)
        copy = prompt_lookup_propose(seq, lookup_tokens, 4, 2) if lookup_tokens else []
        chosen = select_nodes(nodes, budget, copy)
        index = {node: k + 1 for k, node in enumerate(chosen)}                        # tree row of each node
        parents = [index.get(nodes[i].parent, 0) for i in chosen]
        node_tokens = [seq[-1]] + [nodes[i].token for i in chosen]
        depths = torch.tensor([0] + [nodes[i].depth for i in chosen])
        start = cache.length
        logits, hidden = tree_forward(target, cache, torch.tensor(node_tokens, device=device), parents, depths)
        ok = (logits.argmax(-1)[torch.tensor(parents, device=device)]
              == torch.tensor(node_tokens[1:], device=device)).tolist()
        branch = kept_branch(parents, ok)[:max_new_tokens - len(result.tokens)]   # never more than asked for
        new = [node_tokens[i] for i in branch[1:]] + [int(logits[branch[-1]].argmax())]
        compact_cache(cache, start, branch)
        drafter.rollback(cache.length)
        drafter.observe(hidden[branch])                                               # the kept positions' features
        result.proposed.append(int(depths.max()))
        result.accepted.append(len(branch) - 1)
        emit_tokens(new, seq, result, stop, max_new_tokens)
    result.target_forwards = len(result.accepted)
    result.draft_forwards = drafter.forwards
    return result
