"""Quantization-aware training (QAT): train through the quantizer with a straight-through estimator.

Jacob et al. 2018 ("Quantization and Training of Neural Networks for Efficient Integer-Arithmetic-
Only Inference"); Bengio et al. 2013 for the straight-through estimator (STE). The forward pass uses
the fake-quantized weight Q(W) (quantize then dequantize), so the loss sees exactly what the
quantized model will compute; round() has zero gradient almost everywhere, so the backward pass
pretends Q is the identity:  W_q = W + (Q(W) - W).detach().  The weights learn to sit where
rounding hurts least. More expensive than post-training quantization (it is training), and usually
the most accurate at very low bit widths. Here a short fine-tune distils the full-precision model
into its own fake-quantized copy (KL to the teacher) or trains on next-token loss.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import _checks
from .core import check_bits, fake_quantize


def ste_fake_quantize(w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool = False) -> torch.Tensor:
    """Q(w) in the forward pass, identity gradient in the backward pass."""
    granularity = "channel" if group_size is None else "group"
    with torch.no_grad():
        w_q = fake_quantize(w.detach(), bits, symmetric, granularity, group_size)
    return w + (w_q - w).detach()


class FakeQuantLinear(nn.Module):
    """An `nn.Linear` whose forward uses its fake-quantized weight (trainable through the STE)."""

    def __init__(self, linear: nn.Linear, bits: int, group_size: int | None, symmetric: bool = False):
        super().__init__()
        self.linear, self.bits, self.group_size, self.symmetric = linear, check_bits(bits), group_size, symmetric

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, ste_fake_quantize(self.linear.weight, self.bits, self.group_size, self.symmetric))


def _swap(model: nn.Module, names: list[str], make) -> None:
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make(getattr(parent, child)))


def qat_finetune(model: nn.Module, tokens: torch.Tensor, linear_names: list[str], bits: int = 4,
                 group_size: int | None = 128, symmetric: bool = False, steps: int = 100, lr: float = 3e-4,
                 batch_size: int = 8, seq_len: int = 128, teacher: nn.Module | None = None,
                 seed: int = 0) -> list[float]:
    """Fine-tune `model` in place with the linears named in `linear_names` fake-quantized.

    tokens: a 1-D stream of training ids (random windows of `seq_len` are drawn) or a (B, T) batch.
    With a `teacher`, the loss is KL(teacher || model) per position (distillation); else next-token
    cross-entropy. Returns the loss curve. Afterwards the linears are plain `nn.Linear` again, whose
    RTN quantization (same bits, groups, symmetry) is exactly what was trained.
    """
    _checks.positive_int("steps", steps)
    tokens = tokens.reshape(-1) if tokens.dim() == 1 else tokens
    if tokens.dim() == 1 and tokens.numel() < seq_len + 2:
        raise ValueError(f"need more than seq_len + 1 = {seq_len + 1} training tokens, got {tokens.numel()}")
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    _swap(model, linear_names, lambda lin: FakeQuantLinear(lin, bits, group_size, symmetric))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * (1 - s / steps))
    model.train()
    losses = []
    try:
        for _ in range(steps):
            if tokens.dim() == 1:
                starts = torch.randint(0, tokens.numel() - seq_len - 1, (batch_size,), generator=gen)
                batch = torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()]).to(device)
            else:
                batch = tokens[torch.randint(0, tokens.shape[0], (batch_size,), generator=gen)].to(device)
            inputs = batch[:, :-1]
            logits = model(inputs).float()
            if teacher is not None:
                with torch.no_grad():
                    target = torch.log_softmax(teacher(inputs).float(), -1)
                loss = F.kl_div(torch.log_softmax(logits, -1), target, log_target=True, reduction="none").sum(-1).mean()
            else:
                loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
    finally:
        model.eval()
        _swap(model, linear_names, lambda fq: fq.linear)
    return losses
