"""Data for the shipped models: the offline corpus (`corpus`, `grammar`), `training`, `evaluation`."""

from .corpus import RecallProbe, build_corpus, get_batch, load_corpus, make_recall_probe
from .evaluation import compare_to_reference, eval_windows, evaluate_lm, long_range_recall, recall_nll
from .training import TrainConfig, next_token_loss, train_lm, train_model

__all__ = ["RecallProbe", "TrainConfig", "build_corpus", "compare_to_reference", "eval_windows", "evaluate_lm",
           "get_batch", "load_corpus", "long_range_recall", "make_recall_probe", "next_token_loss", "recall_nll",
           "train_lm", "train_model"]
