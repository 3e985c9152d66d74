"""The reference solution, compression: which structures pruning keeps, and the distillation loss that
repairs the pruned model (Minitron: Muralidharan et al. 2024; Hinton et al. 2015).

See the package docstring; each function is a thin wrapper over the library."""

from __future__ import annotations

import torch

from ...compression import distillation as _distillation
from ...compression import pruning as _pruning
from ..registry import graded


@graded("compression")
def structures_to_keep(scores: torch.Tensor, num_keep: int) -> torch.Tensor:
    """Which of n structures (layers, MLP channels, embedding dims) a pruned model keeps.

    scores: (n,) importance (larger = more important). Returns (num_keep,) int64: the indices of the
    num_keep largest scores (on ties the lower index wins), in increasing order (the pruned weights keep
    the original layout)."""
    return _pruning.keep_top(scores, num_keep)


@graded("compression")
def gqa_heads_to_keep(head_scores: torch.Tensor, num_kv_heads: int, keep_kv_heads: int,
                      keep_per_group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which heads a pruned grouped-query attention layer keeps, so its groups stay well formed.

    head_scores: (K G,) importance of the N = K G query heads; query head n belongs to key/value group
    n // G (K = num_kv_heads). Rank the groups by the summed scores of their G query heads and keep the
    best keep_kv_heads (as `structures_to_keep`); inside each kept group keep its keep_per_group best query
    heads (same rule). Returns (kept groups (keep_kv_heads,), kept query heads (keep_kv_heads
    keep_per_group,)) as int64 indices into the original groups and heads, both in increasing order."""
    return _pruning.keep_gqa_heads(head_scores, num_kv_heads, keep_kv_heads, keep_per_group)


@graded("compression")
def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """Knowledge distillation's loss (Hinton et al. 2015): the student learns the teacher's distribution.

    student_logits, teacher_logits: (B, T, V). With p_T = softmax(teacher / temperature) and
    q_T = softmax(student / temperature) at each position: temperature^2 times the mean over the B T
    positions of KL(p_T || q_T) = sum over V of p_T (log p_T - log q_T) (the teacher's distribution
    first: the student pays for missing what the teacher thinks likely). Returns a 0-d float32 tensor,
    differentiable with respect to student_logits."""
    return _distillation.distillation_loss(student_logits, teacher_logits, alpha=1.0, temperature=temperature)
