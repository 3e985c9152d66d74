"""Making a cheaper model: structured `pruning` (Minitron importance) and `distillation`."""

from .distillation import distill, distillation_loss
from .pruning import calibration_batches, importance_scores, prune_model

__all__ = ["calibration_batches", "distill", "distillation_loss", "importance_scores", "prune_model"]
