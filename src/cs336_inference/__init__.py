"""cs336_inference: the executable companion to CS336 Lecture 10 (Inference).

Every algorithm lives once in this package; `lecture/`, `notebooks/` and `tests/` import it.
"""

from .config import ModelConfig
from .device import default_dtype, get_device, seed_everything
from .generate import GenerationResult, decode_one_token, generate, prefill
from .model import TransformerLM
from .sampling import sample_next_token
from .tokenizer import ByteTokenizer

__version__ = "0.1.0"

__all__ = [
    "ByteTokenizer", "GenerationResult", "ModelConfig", "TransformerLM", "decode_one_token",
    "default_dtype", "generate", "get_device", "prefill", "sample_next_token", "seed_everything",
]
