"""EAGLE-2's dynamic draft tree: many candidate continuations from one EAGLE draft, verified in one target pass.

The chain form (`eagle.EagleDrafter`) bets on the draft's best guess at every depth. A small draft's
second or fourth guess is often right where its best is wrong (docs/log.md has SmolLM2's top-k rates),
so EAGLE-2 (Li et al. 2024, arXiv:2406.16858) grows a tree and lets the target pick the branch it
agrees with:

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

Exactness. Greedy (temperature 0): a node is kept iff it is the target's argmax after its parent, so the
output equals plain greedy decoding. Sampled (temperature > 0): each expanded node's children are
draws without replacement from the draft's distribution, and the target checks them in draw order with
the several-candidate rule (`speculative_rule.accept_among_candidates`), so every emitted token is an
exact sample of the target's. That rule needs each child list to be a prefix of the draws whatever the
drawn tokens turn out to be, so a sampled tree keeps the first `budget` draws in the order the nodes
were expanded, instead of the best-scored ones, and takes no copied branch. After each pass the
draft's cache is cut back to its true positions (`EagleDrafter.rollback`), and the kept branch's
target features are what it reads next.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import _checks
from ..model.transformer import TransformerLM
from .eagle import EagleDraft, EagleDrafter
from .generate import stop_token_set
from .medusa_tree import compact_cache, emit_tokens, kept_branch, tree_forward
from .prompt_lookup import prompt_lookup_propose
from .sampling import logits_to_probs
from .speculative import SpeculativeResult
from .speculative_rule import among_candidates_unchecked


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


@dataclass
class Draws:
    """Sampled trees: children are drawn without replacement from the draft's distribution at temperature
    (the Gumbel-top-k trick), at most `budget` nodes in all; `drawn_from[i]` is node i's distribution
    (-1: the root's), which the rule needs (`speculative_rule.accept_among_candidates`)."""

    temperature: float
    budget: int
    generator: torch.Generator | None = None
    drawn_from: dict = field(default_factory=dict)


def _children(drafter: EagleDrafter, features: torch.Tensor, parents: list[int], nodes: list[Node],
              top_k: int, depth: int, draws: Draws | None) -> list[int]:
    """features (n, D): the draft's outputs after each parent -> the indices of their children: the top_k
    guesses of each (greedy), or top_k draws without replacement while the budget lasts (sampled)."""
    logits = drafter.logits(features).float()                                          # (n, V)
    if draws is None:
        scores, tokens = torch.log_softmax(logits, dim=-1).topk(top_k, dim=-1)         # (n, top_k)
    else:
        logq = torch.log_softmax(logits / draws.temperature, dim=-1)
        gumbel = -torch.empty_like(logq, device="cpu").exponential_(generator=draws.generator).log()
        tokens = (logq + gumbel.to(logq.device)).topk(top_k, dim=-1).indices          # in draw order
        scores = logq.gather(-1, tokens)
    added = []
    for row, parent in enumerate(parents):
        keep = top_k
        if draws is not None:
            keep = min(top_k, draws.budget - len(nodes))   # fixed before looking at this parent's draws
            if keep <= 0:
                break
            draws.drawn_from[parent] = logq[row].exp()
        base = nodes[parent].score if parent >= 0 else 0.0
        for s, t in list(zip(scores[row].tolist(), tokens[row].tolist()))[:keep]:
            nodes.append(Node(t, parent, depth, base + s))
            added.append(len(nodes) - 1)
    return added


def grow_tree(drafter: EagleDrafter, sequence: list[int], depth: int, top_k: int,
              draws: Draws | None = None) -> list[Node]:
    """Steps 1 and 2: read the target's pending features, then expand the best top_k nodes of each depth
    (greedy: their top_k guesses each; `draws`: top_k draws each, until the budget is spent).

    Every node of depth d sits at draft position true_len + d - 1 (the chain's d-th draft step) and
    attends to the true positions and its ancestors' slots; the expanded nodes' slots stay in the
    draft's cache until `drafter.rollback`."""
    root_feature = drafter.read_pending(sequence)                                     # (D,)
    cache, true_len = drafter.cache, drafter.true_len
    nodes: list[Node] = []
    frontier = _children(drafter, root_feature[None], [-1], nodes, top_k, 1, draws)
    for d in range(1, depth):
        frontier = sorted(frontier, key=lambda i: -nodes[i].score)[:top_k]
        if draws is not None:   # only the nodes the budget leaves children for
            frontier = frontier[:(draws.budget - len(nodes) + top_k - 1) // top_k]
        if not frontier:
            break
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
        frontier = _children(drafter, out, frontier, nodes, top_k, d + 1, draws)
        drafter.forwards += 1
    drafter.forwards += 1   # the read, and one batched draft forward per depth expanded
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


def _walk_greedy(logits: torch.Tensor, node_tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """(the kept rows from the root, the token after them): keep a child iff it is its parent's argmax."""
    device = logits.device
    argmax = logits.argmax(-1)
    ok = (argmax[torch.tensor(parents, device=device)] == torch.tensor(node_tokens[1:], device=device)).tolist()
    branch = kept_branch(parents, ok)
    return branch, int(argmax[branch[-1]])


def _walk_sampled(logits: torch.Tensor, node_tokens: list[int], parents: list[int], drawn_from: list,
                  temperature: float, generator) -> tuple[list[int], int]:
    """(the kept rows, the token after them): at each kept row, its children in draw order go through
    `accept_among_candidates` against the target's distribution there; drawn_from[row]: the draft's."""
    row, branch = 0, [0]
    while True:
        target_probs = logits_to_probs(logits[row], temperature)
        children = [i for i, parent in enumerate(parents, start=1) if parent == row]
        if not children:
            return branch, int(torch.multinomial(target_probs.cpu(), 1, generator=generator))
        chosen, token = among_candidates_unchecked(drawn_from[row], target_probs,
                                                   [node_tokens[i] for i in children], generator)
        if chosen is None:
            return branch, token
        row = children[chosen]
        branch.append(row)


@torch.inference_mode()
def eagle_tree_generate(target: TransformerLM, draft: EagleDraft, prompt_ids, max_new_tokens: int = 64,
                        depth: int = 6, top_k: int = 8, budget: int = 32, lookup_tokens: int = 0,
                        temperature: float = 0.0, stop_tokens=None,
                        generator: torch.Generator | None = None) -> SpeculativeResult:
    """Decode with EAGLE-2's draft tree (see the module docstring). depth: the tree's depth; top_k: the
    guesses (draws) kept per expanded node and the nodes expanded per depth; budget: the draft nodes the
    target verifies per pass.
    temperature 0 (greedy): the budget's best-scored nodes; equals plain greedy decoding. lookup_tokens > 0
      adds prompt lookup's copy of up to that many tokens as one more branch.
    temperature > 0 (sampled, exact): children drawn without replacement, the first `budget` in the order
      the nodes were expanded, checked by `accept_among_candidates`; the output is distributed as the
      target's samples. (The copy is not drawn from the draft: lookup_tokens must be 0.)
    Returns the tokens with `proposed` (the verified tree's depth) and `accepted` (the kept branch's
    length) per target pass."""
    _checks.instance("draft", draft, EagleDraft)
    for name, value in (("depth", depth), ("top_k", top_k), ("budget", budget)):
        _checks.integer(name, value, 1, None, allowed="an int >= 1")
    _checks.non_negative_int("lookup_tokens", lookup_tokens)
    _checks.non_negative_int("max_new_tokens", max_new_tokens)
    _checks.non_negative_float("temperature", temperature)
    _checks.generator("generator", generator)
    if temperature > 0 and lookup_tokens:
        raise ValueError(f"lookup_tokens={lookup_tokens} needs temperature 0: the copied branch is not drawn from the "
                         f"draft, so the sampled rule cannot check it (got temperature {temperature})")
    drafter = EagleDrafter(target, draft)                                             # checks the shared heads
    prompt = _checks.token_ids("prompt_ids", torch.as_tensor(prompt_ids), target.config.vocab_size, dims=(1,)).tolist()
    stop, device = stop_token_set(stop_tokens, target.config.vocab_size), target.device
    result = SpeculativeResult([], len(prompt), depth)
    if max_new_tokens == 0:
        return result

    def pick(logits_row: torch.Tensor) -> int:   # the target's own token at a position
        if temperature == 0:
            return int(logits_row.argmax())
        return int(torch.multinomial(logits_to_probs(logits_row, temperature).cpu(), 1, generator=generator))

    room = len(prompt) + max_new_tokens
    cache = target.new_cache(1, room + budget + lookup_tokens + 1)
    drafter.start(prompt, room + (depth - 1) * top_k, max_rollback=(depth - 1) * top_k)
    logits, hidden = target(torch.tensor([prompt], device=device), cache=cache, return_hidden=True)
    drafter.observe(hidden[0])                                                        # (P, D)
    seq = prompt + [pick(logits[0, -1])]
    result.tokens.append(seq[-1])
    while len(result.tokens) < max_new_tokens and seq[-1] not in stop:
        draws = Draws(temperature, budget, generator) if temperature > 0 else None
        nodes = grow_tree(drafter, seq, depth, top_k, draws)
        if draws is None:
            copy = prompt_lookup_propose(seq, lookup_tokens, 4, 2) if lookup_tokens else []
            chosen = select_nodes(nodes, budget, copy)
        else:                   # every node drawn (the budget capped the draws), siblings in draw order
            chosen = sorted(range(len(nodes)), key=lambda i: nodes[i].depth)
        index = {node: k + 1 for k, node in enumerate(chosen)}                        # tree row of each node
        parents = [index.get(nodes[i].parent, 0) for i in chosen]
        node_tokens = [seq[-1]] + [nodes[i].token for i in chosen]
        depths = torch.tensor([0] + [nodes[i].depth for i in chosen])
        start = cache.length
        logits, hidden = tree_forward(target, cache, torch.tensor(node_tokens, device=device), parents, depths)
        if draws is None:
            branch, token = _walk_greedy(logits, node_tokens, parents)
        else:
            drawn_from = [draws.drawn_from.get(i) for i in [-1] + chosen]             # per tree row
            branch, token = _walk_sampled(logits, node_tokens, parents, drawn_from, temperature, generator)
        # never more than asked for: a prefix of the pass's tokens (not a fresh draw after a cut branch,
        # which would mix the rule's two outcomes wrongly)
        new = ([node_tokens[i] for i in branch[1:]] + [token])[:max_new_tokens - len(result.tokens)]
        branch = branch[:len(new)]
        compact_cache(cache, start, branch)
        drafter.rollback(cache.length)
        drafter.observe(hidden[branch])                                               # the kept positions' features
        result.proposed.append(int(depths.max()))
        result.accepted.append(len(branch) - 1)
        emit_tokens(new, seq, result, stop, max_new_tokens)
    result.target_forwards = len(result.accepted)
    result.draft_forwards = drafter.forwards
    return result
