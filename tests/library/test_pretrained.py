"""The shipped models are the trained ones: they load offline and reach the metrics stored beside them."""

import math

import pytest
import torch
from adapters import config_from_name, run_compare_to_reference, run_evaluate_lm, run_load_corpus, run_prune_model

from cs336_inference.model import checkpoints
from cs336_inference.shipped_models import get_train_preset


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


SHIPPED = ("target", "draft", "draft-scratch")
# The recorded loss was measured on these bf16 weights loaded in fp32; re-measuring on another CPU
# differs only by float summation order (~1e-6 nats), so 0.01 nats is a generous, still-meaningful bound
# (an untrained model scores ~5.5 nats, a half-trained one is off by > 0.1).
LOSS_TOLERANCE = 0.01


QUICK_EVAL = dict(seq_len=256, batch_size=4, max_batches=2)   # 2 x 4 windows of 256 bytes of the val split


def _extra(name):
    return checkpoints.load_extra(checkpoints.ASSETS / f"{name}.pt")


@pytest.fixture(scope="module")
def measured():
    """Loss and bits/byte of each shipped model, measured here on the val split (never the numbers the
    training run recorded in the checkpoint)."""
    val = run_load_corpus("val")
    return {name: run_evaluate_lm(checkpoints.load_pretrained(name), val, **QUICK_EVAL) for name in SHIPPED}


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


def test_shipped_shapes_sizes_and_quality(measured):
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
    assert measured["target"]["bits_per_byte"] < 0.5 * unigram_bpb
    assert measured["target"]["bits_per_byte"] < measured["draft"]["bits_per_byte"]
    # distillation against training the same draft from scratch for the same steps
    assert measured["draft"]["bits_per_byte"] < measured["draft-scratch"]["bits_per_byte"]
    assert math.isfinite(_extra("draft")["train_time_s"])


def test_distilled_draft_agrees_with_target():
    target, draft = checkpoints.load_pretrained("target"), checkpoints.load_pretrained("draft")
    extra = _extra("draft")
    assert extra["method"] == "prune+distill" and extra["teacher"] == "target"
    out = run_compare_to_reference(draft, target, run_load_corpus("val"), seq_len=256, batch_size=4, max_batches=2)
    assert out["top1_agreement"] > 0.5


@pytest.mark.slow
def test_distillation_improved_on_the_pruned_model(measured):
    """Redo the draft recipe's pruning step (~40 s) and measure the model before distillation: the shipped
    draft must be far better than it."""
    spec = get_train_preset("draft")
    cfg = config_from_name(spec["model"])
    n = spec["calibration_samples"]
    calibration = run_load_corpus("train", spec["train"].data_seed)[: n * 513].view(n, 513)
    pruned = run_prune_model(checkpoints.load_pretrained("target"), calibration, num_layers=cfg.num_layers,
                             num_kv_heads=cfg.num_kv_heads, num_heads=cfg.num_heads, d_ff=cfg.d_ff)
    assert pruned.config == cfg
    before = run_evaluate_lm(pruned, run_load_corpus("val"), **QUICK_EVAL)["loss"]
    assert measured["draft"]["loss"] < 0.5 * before, f"draft {measured['draft']['loss']:.3f} nats, pruned {before:.3f}"
