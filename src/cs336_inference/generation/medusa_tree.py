"""Medusa's tree attention: verify many candidate continuations in one target forward (Cai et al. 2024).

The chain form (`medusa.MedusaDrafter`) bets on one guess per head. The heads' top few guesses
combine into a tree: each path root -> node is one candidate continuation, and the nodes share their
common prefixes. One forward of the target over every node, where node i attends to the cached
context, the root (the last emitted token) and its own ancestors only (`tree_mask`), at RoPE position
(context + its depth), computes exactly what the target would compute on each branch run alone. The
longest branch the target agrees with is kept; its keys and values are moved to the contiguous
positions they would have had (`compact_cache`) and the rest is rolled back.

Acceptance rules (`medusa_tree_generate(rule=...)`):
  "greedy"   keep a node iff its token is the target's argmax at its parent: the output equals plain
             greedy decoding (exact for temperature 0).
  "typical"  NOT EXACT: Medusa-2's typical acceptance, a heuristic for sampling. Keep a node iff the
             target gives its token probability > min(epsilon, delta * exp(-entropy)) at its parent;
             the token after the kept branch is sampled from the target. The output is *not*
             distributed as the target's samples (it favours the heads' likely guesses); use the
             chain form with the accept/resample rule (`speculative_rule`) when exactness matters.

A tree is a list of paths (tuples of ranks: (0, 1) = head 1's top guess, then head 2's second guess),
closed under prefixes, as the Medusa paper's "choices" lists.
"""

from __future__ import annotations

import torch

from .. import _checks
from ..model.kv_cache import ContiguousKVCache, KVCache
from ..model.transformer import TransformerLM
from .draft_vocab import DraftHead
from .generate import stop_token_set
from .medusa import MedusaHeads, check_heads_match
from .sampling import sample_next_token
from .speculative import SpeculativeResult

# A small default tree (12 nodes, 4 deep: the shipped heads): wide at depth 1, where the heads are surest.
DEFAULT_TREE = ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
                (0, 0, 0, 0))


def check_tree(tree, num_heads: int) -> tuple[tuple[int, ...], ...]:
    """A tree: non-empty tuples of ranks >= 0, no deeper than the heads, each path's prefix present."""
    paths = tuple(tuple(p) for p in tree) if isinstance(tree, (list, tuple)) else None
    if not paths or any(not p or any(not isinstance(r, int) or r < 0 for r in p) for p in paths):
        raise ValueError(f"tree must be a non-empty list of non-empty tuples of ranks >= 0, got {tree!r}")
    if len(set(paths)) != len(paths):
        raise ValueError("tree has a repeated path")
    if max(len(p) for p in paths) > num_heads:
        raise ValueError(f"tree is {max(len(p) for p in paths)} deep but there are only {num_heads} heads")
    missing = [p for p in paths if len(p) > 1 and p[:-1] not in paths]
    if missing:
        raise ValueError(f"tree paths {missing} lack their parent path (a tree is closed under prefixes)")
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


def tree_mask(parents: list[int]) -> torch.Tensor:
    """(T+1, T+1) bool, node 0 the root: row i may attend to column j iff j is i or an ancestor of i.
    parents[i - 1] is node i's parent (0 = the root); parents come before children."""
    n = len(parents) + 1
    mask = torch.eye(n, dtype=torch.bool)
    mask[:, 0] = True
    for i, parent in enumerate(parents, start=1):
        mask[i] |= mask[parent]
    return mask


def tree_forward(target: TransformerLM, cache: KVCache, tokens: torch.Tensor, parents: list[int],
                 depths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over the tree: tokens (T+1,) (root first), depths (T+1,) -> logits (T+1, V),
    hidden (T+1, D). Node i sits at position cache.length + depths[i], sees the context, then its
    ancestors; its key and value land in slot cache.length + i (see `compact_cache`)."""
    step = cache.begin(len(tokens))
    S = step.start
    step.positions = S + depths.to(cache.device)                                      # (T+1,) RoPE positions
    context = torch.ones(len(tokens), S, dtype=torch.bool, device=cache.device)
    step.mask = torch.cat([context, tree_mask(parents).to(cache.device)], dim=1)[None, None]   # (1, 1, T+1, S+T+1)
    logits, hidden = target(tokens[None], step=step, return_hidden=True)
    return logits[0], hidden[0]


def compact_cache(cache: KVCache, start: int, slots: list[int]) -> None:
    """Move the kept nodes' keys/values (slots, relative to start) to start, start + 1, ... and keep only them."""
    index = torch.tensor(slots, device=cache.device) + start
    for layer in cache.unique_layers():
        if not isinstance(layer, ContiguousKVCache):
            raise ValueError(f"tree verification needs contiguous attention caches, got {type(layer).__name__}")
        for buf in (layer.k, layer.v):
            buf[:, :, start:start + len(slots)] = buf[:, :, index]
    cache.truncate(start + len(slots))


def _typical(probs: torch.Tensor, epsilon: float, delta: float) -> torch.Tensor:
    """(T+1, V) -> (T+1,) the threshold min(epsilon, delta * exp(-H)) of each row."""
    entropy = -(probs * probs.clamp_min(1e-12).log()).sum(-1)
    return torch.minimum(torch.full_like(entropy, epsilon), delta * torch.exp(-entropy))


@torch.inference_mode()
def medusa_tree_generate(target: TransformerLM, heads: MedusaHeads, prompt_ids, max_new_tokens: int = 64,
                         tree=DEFAULT_TREE, rule: str = "greedy", temperature: float = 1.0, epsilon: float = 0.3,
                         delta: float = 0.09, stop_tokens=None,
                         generator: torch.Generator | None = None) -> SpeculativeResult:
    """Decode with tree verification. rule "greedy" (exact: equals greedy decoding) or "typical"
    (NOT exact, see the module docstring; temperature, epsilon, delta apply). Returns the tokens with
    `proposed` (the tree's depth) and `accepted` (the kept branch's length) per target pass."""
    _checks.instance("heads", heads, MedusaHeads)
    check_heads_match(target, heads.d_model, "the Medusa heads")
    _checks.one_of("rule", rule, ("greedy", "typical"))
    _checks.non_negative_int("max_new_tokens", max_new_tokens)
    paths = check_tree(tree, heads.num_heads)
    prompt = _checks.token_ids("prompt_ids", torch.as_tensor(prompt_ids), target.config.vocab_size, dims=(1,)).tolist()
    head = DraftHead(target, heads.vocab)   # the LM head over the ids the heads rank (`draft_vocab`)
    depth = max(len(p) for p in paths)
    parents = [0 if len(p) == 1 else 1 + paths.index(p[:-1]) for p in paths]
    depths = torch.tensor([0] + [len(p) for p in paths])
    ranks = max(r for p in paths for r in p) + 1
    stop, device = stop_token_set(stop_tokens, target.config.vocab_size), target.device
    result = SpeculativeResult([], len(prompt), depth)
    if max_new_tokens == 0:
        return result
    cache = target.new_cache(1, len(prompt) + max_new_tokens + len(paths) + 1)

    def pick(logits):   # the token after a position: greedy, or a sample for "typical"
        return int(logits.argmax()) if rule == "greedy" else int(sample_next_token(logits, temperature,
                                                                                     generator=generator))
    logits, hidden = target(torch.tensor([prompt], device=device), cache=cache, last_only=True, return_hidden=True)
    seq, last = list(prompt), hidden[0, -1]
    seq.append(pick(logits[0, -1]))
    result.tokens.append(seq[-1])
    while len(result.tokens) < max_new_tokens and seq[-1] not in stop:
        guesses = head(heads(target.ln_final(last))).topk(ranks, -1).indices.tolist()   # (K, ranks)
        node_tokens = [seq[-1]] + [guesses[len(p) - 1][p[-1]] for p in paths]
        start = cache.length
        logits, hidden = tree_forward(target, cache, torch.tensor(node_tokens, device=device), parents, depths)
        branch = kept_branch(parents, _accepted_nodes(rule, logits, node_tokens, parents, temperature, epsilon,
                                                      delta))
        room = max_new_tokens - len(result.tokens) - 1
        branch = branch[:room + 1]          # never more tokens than asked for
        new = [node_tokens[i] for i in branch[1:]] + [pick(logits[branch[-1]])]
        compact_cache(cache, start, branch)
        last = hidden[branch[-1]]
        result.proposed.append(depth)
        result.accepted.append(len(branch) - 1)
        emit_tokens(new, seq, result, stop, max_new_tokens)
    result.target_forwards = len(result.accepted)
    return result


def _accepted_nodes(rule: str, logits: torch.Tensor, node_tokens: list[int], parents: list[int],
                    temperature: float, epsilon: float, delta: float) -> list[bool]:
    """Whether each tree node (not the root) passes its parent's test: the parent's argmax ("greedy", exact)
    or probability above the typical threshold ("typical", not exact). logits (T+1, V), row 0 the root."""
    parent, tokens = torch.tensor(parents), torch.tensor(node_tokens[1:], device=logits.device)
    if rule == "greedy":
        return (logits.argmax(-1)[parent] == tokens).tolist()
    probs = torch.softmax(logits.float() / temperature, -1)                           # (T+1, V)
    return (probs[parent, tokens] > _typical(probs, epsilon, delta)[parent]).tolist()


def kept_branch(parents: list[int], ok: list[bool]) -> list[int]:
    """The nodes kept, from the root (0) down: the first accepted child of each kept node."""
    node, branch = 0, [0]
    while (child := next((i for i, par in enumerate(parents, start=1) if par == node and ok[i - 1]), None)) is not None:
        node = child
        branch.append(node)
    return branch


def emit_tokens(new: list[int], seq: list[int], result: SpeculativeResult, stop: set, max_new_tokens: int) -> None:
    """Append a pass's tokens, up to the first stop token or max_new_tokens."""
    for t in new:
        seq.append(t)
        result.tokens.append(t)
        if t in stop or len(result.tokens) >= max_new_tokens:
            break
