"""Structured pruning, the first half of the Minitron recipe (distillation, the second, is next door).

Minitron (Muralidharan et al. 2024, "Compact Language Models via Pruning and Knowledge
Distillation"; Sreenivas et al. 2024, "LLM Pruning and Distillation in Practice"):
  1. score the importance of layers, attention heads, MLP channels and embedding channels from
     activations on a small calibration set (no gradients needed);
  2. cut the least important ones, keeping the model a plain `TransformerLM` of the smaller shape;
  3. repair the damage by distilling the original model into the pruned one (KL to the teacher's
     next-token distribution; Hinton et al. 2015), optionally plus the usual next-token loss.

GQA: query heads come in groups of G sharing one key/value head, so heads are removed in a way
that keeps the groups well formed: whole KV groups (K -> K') ranked by the summed importance of
their query heads, and, if G shrinks too, the same number of query heads inside each kept group.
This model derives the head dim as H = D / N, so the number of query heads and d_model shrink
together (H stays fixed and every kept head keeps its weights unchanged).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange

from .. import _checks
from ..data.evaluation import eval_windows
from ..model.transformer import TransformerLM

__all__ = ["calibration_batches", "importance_scores", "keep_gqa_heads", "keep_top", "prune_model"]


def calibration_batches(calibration, seq_len: int = 256, batch_size: int = 8) -> list[torch.Tensor]:
    """Calibration data as a list of (B, T) id batches: accepts a (num_samples, T) tensor, a 1-D
    token stream (cut into consecutive windows of seq_len), or a list of (B, T) tensors."""
    if isinstance(calibration, torch.Tensor):
        if calibration.numel() == 0:
            raise ValueError("calibration set is empty; pass token ids (e.g. a slice of load_corpus('train'))")
        if calibration.dim() == 1:
            if calibration.numel() < 2:
                raise ValueError(f"calibration stream has {calibration.numel()} tokens; need at least 2")
            seq_len = min(seq_len, calibration.numel() - 1)
            return [x for x, _ in eval_windows(calibration, seq_len, batch_size)]
        if calibration.dim() == 2:
            return list(calibration.split(batch_size))
        raise ValueError(f"calibration tensor must be 1-D (a stream) or 2-D (B, T), got {tuple(calibration.shape)}")
    if isinstance(calibration, (list, tuple)):
        if not calibration:
            raise ValueError("calibration set is empty; pass token ids (e.g. a slice of load_corpus('train'))")
        return [torch.as_tensor(b) for b in calibration]
    raise TypeError(f"calibration must be a tensor of token ids or a list of (B, T) tensors, "
                    f"got {type(calibration).__name__}")


@torch.no_grad()
def importance_scores(model: TransformerLM, calibration, seq_len: int = 256, batch_size: int = 8) -> dict:
    """Activation-based importance of every prunable structure, from forward passes on `calibration`.

    heads (L, N): mean L2 norm of each head's attention output (the input of output_proj);
    kv_groups (L, K): the sum over the G query heads of each group;
    mlp (L, F): mean |activation| of each SwiGLU hidden channel (the input of w2);
    embedding (D,): mean |value| of each channel of the residual stream where it enters every
    RMSNorm, summed over the norms (Minitron scores the LayerNorm outputs instead, which also
    weighs each dim by its norm gain; the shipped draft was made with this input-side score);
    layers (L,): increase of the calibration loss when the layer is skipped (Minitron's depth metric);
    layers_bi (L,): block importance 1 - cos(x_in, x_out) (ShortGPT, Men et al. 2024).
    """
    _checks.instance("model", model, TransformerLM, "a TransformerLM")
    batches = calibration_batches(calibration, min(seq_len, model.config.context_length), batch_size)
    cfg = model.config
    L, N, K, H, D, Fdim = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.d_model, cfg.d_ff
    heads, mlp = torch.zeros(L, N), torch.zeros(L, Fdim)
    embedding, block_bi = torch.zeros(D), torch.zeros(L)
    tokens = 0

    def head_hook(i):
        def hook(module, args):
            out = rearrange(args[0].float(), "B T (N H) -> B T N H", H=H)
            heads[i] += out.norm(dim=-1).sum(dim=(0, 1)).cpu()
        return hook

    def mlp_hook(i):
        def hook(module, args):
            mlp[i] += args[0].float().abs().sum(dim=(0, 1)).cpu()
        return hook

    def norm_hook(module, args):
        embedding.add_(args[0].float().abs().sum(dim=(0, 1)).cpu())

    def block_hook(i):
        def hook(module, args, output):
            block_bi[i] += (1 - F.cosine_similarity(args[0].float(), output[0].float(), dim=-1)).sum().cpu()
        return hook

    handles = []
    for i, block in enumerate(model.layers):
        handles.append(block.attn.output_proj.register_forward_pre_hook(head_hook(i)))
        handles.append(block.ffn.w2.register_forward_pre_hook(mlp_hook(i)))
        handles.append(block.ln1.register_forward_pre_hook(norm_hook))
        handles.append(block.ln2.register_forward_pre_hook(norm_hook))
        handles.append(block.register_forward_hook(block_hook(i)))
    handles.append(model.ln_final.register_forward_pre_hook(norm_hook))
    was_training = model.training
    model.eval()
    base_loss = 0.0
    try:
        for x in batches:
            x = x.to(model.device)
            logits = model(x[:, :-1])
            base_loss += F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten(), reduction="sum").item()
            tokens += x[:, :-1].numel()
    finally:
        for h in handles:
            h.remove()
    layers = torch.zeros(L)
    for i in range(L):  # skip layer i: the loss increase is how much the model relies on it
        kept = _without_layer(model, i)
        loss = sum(F.cross_entropy(kept(x.to(model.device)[:, :-1]).flatten(0, 1).float(),
                                   x.to(model.device)[:, 1:].flatten(), reduction="sum").item() for x in batches)
        layers[i] = (loss - base_loss) / tokens
    model.train(was_training)
    heads, mlp, embedding, block_bi = heads / tokens, mlp / tokens, embedding / tokens, block_bi / tokens
    kv_groups = rearrange(heads, "L (K G) -> L K G", K=K).sum(-1)
    return {"layers": layers, "layers_bi": block_bi, "heads": heads, "kv_groups": kv_groups, "mlp": mlp,
            "embedding": embedding, "calibration_loss": base_loss / tokens, "calibration_tokens": tokens}


def _without_layer(model: TransformerLM, skip: int):
    """model's forward with block `skip` replaced by the identity (weights shared, nothing copied)."""
    class _Skip(torch.nn.Module):
        def forward(self, x, *args, **kwargs):
            return x, None  # a block returns (x, keys/values); a skipped layer has none

    def run(x):
        original = model.layers[skip]
        model.layers[skip] = _Skip()
        try:
            return model(x)
        finally:
            model.layers[skip] = original
    return run


def _target(name: str, value, current: int, ratio) -> int:
    """The number of `name` units to keep: an explicit int, else current * (1 - ratio), else current."""
    if value is None:
        return current if ratio is None else max(1, round(current * (1 - ratio)))
    return _checks.integer(name, value, 1, current,
                           allowed=f"an int in [1, {current}] (how many to keep; the model has {current})")


def keep_top(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores, in their original order (ties broken by lower index): what a
    pruned model keeps, laid out as in the original (its weights are sliced in that order)."""
    order = torch.argsort(-scores, stable=True)[:k]
    return torch.sort(order).values


def keep_gqa_heads(head_scores: torch.Tensor, num_kv_heads: int, keep_kv: int, keep_group: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Which heads a GQA layer keeps: head_scores (K G,) of query heads, K = num_kv_heads groups of G.
    Whole KV groups are ranked by the summed importance of their G query heads (keep_kv kept), and inside
    each kept group its keep_group best query heads stay. Returns (kept groups (keep_kv,), kept query heads
    (keep_kv keep_group,)), both in the original order."""
    per_group = rearrange(head_scores, "(K G) -> K G", K=num_kv_heads)                  # (K, G)
    groups = keep_top(per_group.sum(-1), keep_kv)                                         # (K',)
    G = per_group.shape[1]
    heads = torch.cat([g * G + keep_top(per_group[g], keep_group) for g in groups.tolist()])
    return groups, heads


@torch.no_grad()
def prune_model(model: TransformerLM, calibration, *, num_layers: int | None = None,
                num_heads: int | None = None, num_kv_heads: int | None = None, d_ff: int | None = None,
                d_model: int | None = None, prune_ratio: float | None = None, layer_metric: str = "layers",
                scores: dict | None = None) -> TransformerLM:
    """A new, smaller `TransformerLM` holding the most important structures of `model` (unchanged).

    Give how many of each to keep (num_layers, num_heads, num_kv_heads, d_ff, d_model), or
    prune_ratio in (0, 1): the fraction of layers, KV groups and MLP channels to remove (explicit
    counts win). Heads and d_model are tied by H = D / N: give either. `scores` reuses the output
    of `importance_scores` (otherwise computed on `calibration`).
    """
    _checks.instance("model", model, TransformerLM, "a TransformerLM")
    if prune_ratio is not None:
        _checks.probability("prune_ratio", prune_ratio, allow_zero=False, allow_one=False)
    _checks.one_of("layer_metric", layer_metric, ("layers", "layers_bi"))   # loss increase / block importance
    cfg = model.config
    if cfg.attention_type != "gqa" or cfg.kv_share_group != 1:
        raise ValueError(f"prune_model supports GQA models without cross-layer KV sharing, got "
                         f"attention_type={cfg.attention_type!r}, kv_share_group={cfg.kv_share_group}")
    cfg.require_handout_base("prune_model")   # it slices ln1/ln2/ln_final and w1/w2/w3
    H = cfg.head_dim
    new_L = _target("num_layers", num_layers, cfg.num_layers, prune_ratio)
    new_K = _target("num_kv_heads", num_kv_heads, cfg.num_kv_heads, prune_ratio)
    new_F = _target("d_ff", d_ff, cfg.d_ff, prune_ratio)
    if d_model is not None and num_heads is None:
        if _checks.positive_int("d_model", d_model) % H:
            raise ValueError(f"d_model must be a multiple of the head dim H = {H} (H = D / N is kept), got {d_model!r}")
        num_heads = d_model // H
    default_N = new_K * cfg.group_size  # keep G unless told otherwise
    new_N = _target("num_heads", num_heads, cfg.num_heads, None) if num_heads is not None else default_N
    if d_model is not None and d_model != new_N * H:
        raise ValueError(f"d_model ({d_model}) must equal num_heads ({new_N}) x head dim ({H}): this model "
                         "derives H = D / N, so heads and d_model shrink together")
    if new_N % new_K:
        raise ValueError(f"num_heads ({new_N}) must be a multiple of num_kv_heads ({new_K})")
    new_G = new_N // new_K
    if new_G > cfg.group_size:
        raise ValueError(f"num_heads / num_kv_heads = {new_G} exceeds the model's group size {cfg.group_size}; "
                         "pruning cannot add query heads to a group")
    new_D = new_N * H
    scores = importance_scores(model, calibration) if scores is None else scores

    keep_layers = keep_top(scores[layer_metric], new_L).tolist()
    keep_dims = keep_top(scores["embedding"], new_D)
    new_config = cfg.replace(num_layers=new_L, num_heads=new_N, num_kv_heads=new_K, d_ff=new_F, d_model=new_D)
    pruned = TransformerLM(new_config, device=model.device, dtype=model.dtype)
    dev = model.device
    d_idx = keep_dims.to(dev)
    pruned.token_embeddings.weight.copy_(model.token_embeddings.weight[:, d_idx])
    pruned.lm_head.weight.copy_(model.lm_head.weight[:, d_idx])
    pruned.ln_final.weight.copy_(model.ln_final.weight[d_idx])
    for new_i, i in enumerate(keep_layers):
        src, dst = model.layers[i], pruned.layers[new_i]
        groups, q_heads = keep_gqa_heads(scores["heads"][i], cfg.num_kv_heads, new_K, new_G)   # (K',), (N',)
        q_rows = (q_heads[:, None] * H + torch.arange(H)[None]).flatten().to(dev)     # (N' H,)
        kv_rows = (groups[:, None] * H + torch.arange(H)[None]).flatten().to(dev)     # (K' H,)
        ch = keep_top(scores["mlp"][i], new_F).to(dev)
        dst.ln1.weight.copy_(src.ln1.weight[d_idx])
        dst.ln2.weight.copy_(src.ln2.weight[d_idx])
        dst.attn.q_proj.weight.copy_(src.attn.q_proj.weight[q_rows][:, d_idx])
        dst.attn.k_proj.weight.copy_(src.attn.k_proj.weight[kv_rows][:, d_idx])
        dst.attn.v_proj.weight.copy_(src.attn.v_proj.weight[kv_rows][:, d_idx])
        dst.attn.output_proj.weight.copy_(src.attn.output_proj.weight[d_idx][:, q_rows])
        dst.ffn.w1.weight.copy_(src.ffn.w1.weight[ch][:, d_idx])
        dst.ffn.w3.weight.copy_(src.ffn.w3.weight[ch][:, d_idx])
        dst.ffn.w2.weight.copy_(src.ffn.w2.weight[d_idx][:, ch])
    pruned.pruned_from = {"layers": keep_layers, "d_model_channels": keep_dims.tolist()}
    return pruned.eval()
