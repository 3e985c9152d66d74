"""Knowledge distillation: train a small student to match a teacher's next-token distributions.

Hinton et al. 2015 (KL to the teacher's softened distribution); the repair step of Minitron
(Muralidharan et al. 2024) after structured pruning (`pruning.prune_model`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _checks
from ..data.training import TrainConfig, next_token_loss, train_model
from ..model.transformer import TransformerLM

__all__ = ["distill", "distillation_loss"]


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor | None = None,
                      alpha: float = 1.0, temperature: float = 1.0) -> torch.Tensor:
    """alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * cross-entropy(student, targets).

    Logits (B, T, V); KL averaged over positions. T^2 keeps gradient size independent of the
    temperature (Hinton et al. 2015).
    """
    logp = F.log_softmax(student_logits.float() / temperature, dim=-1)
    logq = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    kl = (logq.exp() * (logq - logp)).sum(-1).mean()
    loss = alpha * temperature ** 2 * kl
    if alpha < 1:
        if targets is None:
            raise ValueError("alpha < 1 mixes in next-token loss, which needs targets")
        loss = loss + (1 - alpha) * F.cross_entropy(student_logits.flatten(0, 1).float(), targets.flatten())
    return loss


def distill(student: TransformerLM, teacher: TransformerLM, train_config: TrainConfig,
            train_data: torch.Tensor | None = None, val_data: torch.Tensor | None = None, alpha: float = 1.0,
            temperature: float = 1.0, desc: str = "distill", **kwargs) -> tuple[TransformerLM, dict]:
    """Train `student` (in place) to match `teacher`'s next-token distributions; return (student, history).

    Uses `train.train_model` (AdamW, cosine schedule, clipping, validation, checkpoints) with
    `distillation_loss`; alpha=1 is pure distillation, alpha<1 adds the next-token loss.
    """
    _checks.instance("student", student, TransformerLM, "a TransformerLM")
    _checks.instance("teacher", teacher, TransformerLM, "a TransformerLM")
    if teacher.config.vocab_size != student.config.vocab_size:
        raise ValueError(f"vocab sizes differ: student {student.config.vocab_size}, "
                         f"teacher {teacher.config.vocab_size}")
    _checks.probability("alpha", alpha)
    _checks.finite_positive_float("temperature", temperature)
    teacher.eval()
    flags = [p.requires_grad for p in teacher.parameters()]
    teacher.requires_grad_(False)

    def loss_fn(model, x, y):
        if alpha == 0:
            return next_token_loss(model, x, y)
        with torch.no_grad():
            teacher_logits = teacher(x.to(teacher.device)).to(model.device)
        return distillation_loss(model(x), teacher_logits, y, alpha, temperature)

    try:
        return train_model(student, train_config, train_data, val_data, loss_fn=loss_fn, desc=desc, **kwargs)
    finally:
        for p, flag in zip(teacher.parameters(), flags):
            p.requires_grad_(flag)
