"""The shipped models are the trained ones: they load offline and reach the metrics stored beside them."""

import math

import pytest
import torch
from adapters import config_from_name, run_compare_to_reference, run_evaluate_lm, run_load_corpus

from cs336_inference.model import checkpoints


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


SHIPPED = ("target", "draft", "draft-scratch")
# The recorded loss was measured on these bf16 weights loaded in fp32; re-measuring on another CPU
# differs only by float summation order (~1e-6 nats), so 0.01 nats is a generous, still-meaningful bound
# (an untrained model scores ~5.5 nats, a half-trained one is off by > 0.1).
LOSS_TOLERANCE = 0.01


def _extra(name):
    return checkpoints.load_extra(checkpoints.ASSETS / f"{name}.pt")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_model_reaches_its_recorded_val_loss(name):
    assert name in checkpoints.available_pretrained(), \
        f"assets/{name}.pt is missing: run `python -m cs336_inference train --preset {name}`"
    model = checkpoints.load_pretrained(name)
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    extra = _extra(name)
    measured = run_evaluate_lm(model, run_load_corpus("val"), **extra["val_quick_eval"])["loss"]
    assert abs(measured - extra["val_quick"]["loss"]) < LOSS_TOLERANCE, \
        f"{name}: measured {measured:.4f} nats, recorded {extra['val_quick']['loss']:.4f}"


def test_shipped_shapes_sizes_and_quality():
    target, draft, scratch = (checkpoints.load_pretrained(n) for n in SHIPPED)
    assert target.config == config_from_name("target")
    assert draft.config == scratch.config == config_from_name("draft")
    assert 1_500_000 < target.num_parameters() < 5_000_000
    ratio = target.num_parameters(exclude_embeddings=True) / draft.num_parameters(exclude_embeddings=True)
    assert ratio > 8, f"the draft should be ~10x cheaper per token, it is {ratio:.1f}x"
    total = sum((checkpoints.ASSETS / f"{n}.pt").stat().st_size for n in SHIPPED)
    assert total < 8e6, f"shipped assets take {total / 1e6:.1f} MB; keep the package a few MB"
    # Well below a unigram model of the corpus (~4.6 bits/byte) and below a uniform one (8.0).
    val = run_load_corpus("val")
    unigram = torch.bincount(val, minlength=257).double() / val.numel()
    unigram_bpb = float(-(unigram[unigram > 0] * unigram[unigram > 0].log2()).sum())
    assert _extra("target")["val"]["bits_per_byte"] < 0.5 * unigram_bpb
    assert _extra("target")["val"]["bits_per_byte"] < _extra("draft")["val"]["bits_per_byte"]
    assert math.isfinite(_extra("draft")["train_time_s"])


def test_distilled_draft_agrees_with_target_better_than_before_distillation():
    target, draft = checkpoints.load_pretrained("target"), checkpoints.load_pretrained("draft")
    extra = _extra("draft")
    assert extra["method"] == "prune+distill" and extra["teacher"] == "target"
    assert extra["val"]["loss"] < extra["pruned_before_distill"]["loss"]
    out = run_compare_to_reference(draft, target, run_load_corpus("val"), seq_len=256, batch_size=4, max_batches=2)
    assert out["top1_agreement"] > 0.5
