"""Training: loss goes down, the schedule is the stated one, runs resume to the same state."""

import math

import pytest
import torch
from adapters import (make_config, make_model, make_train_config, run_evaluate_lm, run_load_corpus, run_lr_at,
                      run_train_lm)


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


TINY = dict(vocab_size=257, context_length=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64)


def _small_data():
    return run_load_corpus("train")[:200_000], run_load_corpus("val")[:20_000]


def test_a_few_steps_reduce_the_loss():
    train, val = _small_data()
    cfg = make_train_config(steps=40, batch_size=8, seq_len=32, lr=1e-2, warmup_steps=5, eval_every=40,
                            eval_batches=4, progress=False)
    torch.manual_seed(cfg.seed)
    untrained = make_model(make_config(**TINY))
    before = run_evaluate_lm(untrained, val, 32, batch_size=8, max_batches=4)["loss"]
    model, history = run_train_lm(make_config(**TINY), cfg, train_data=train, val_data=val)
    after = run_evaluate_lm(model, val, 32, batch_size=8, max_batches=4)["loss"]
    assert after < before - 1.0, f"validation loss went from {before:.3f} to {after:.3f} nats"
    assert history["val_loss"][-1] == pytest.approx(after, rel=1e-6)
    assert len(history["train_loss"]) == 40 and history["tokens_seen"] == 40 * 8 * 32


def test_lr_schedule_is_warmup_then_cosine():
    cfg = make_train_config(steps=110, lr=1.0, min_lr_ratio=0.1, warmup_steps=10)
    assert run_lr_at(0, cfg) == pytest.approx(0.1) and run_lr_at(9, cfg) == pytest.approx(1.0)
    assert run_lr_at(10, cfg) == pytest.approx(1.0)
    assert run_lr_at(109, cfg) == pytest.approx(0.1)
    mid = 10 + 99 / 2
    assert run_lr_at(int(mid), cfg) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * (int(mid) - 10) / 99)))


def test_checkpoint_mid_run_resumes_to_the_same_state(tmp_path):
    train, val = _small_data()
    common = dict(steps=6, batch_size=4, seq_len=16, lr=5e-3, warmup_steps=2, eval_every=3, eval_batches=1,
                  progress=False)
    straight, h1 = run_train_lm(make_config(**TINY), make_train_config(**common), train_data=train, val_data=val)
    cfg = make_train_config(**common, checkpoint_path=str(tmp_path / "run.pt"))
    run_train_lm(make_config(**TINY), cfg, train_data=train, val_data=val, stop_at=3)  # "interrupted"
    resumed, h2 = run_train_lm(make_config(**TINY), cfg, train_data=train, val_data=val, resume=True)
    for name, tensor in straight.state_dict().items():
        assert torch.equal(tensor, resumed.state_dict()[name]), f"{name} differs after resuming"
    assert h1["train_loss"] == h2["train_loss"] and h1["val_loss"] == h2["val_loss"]


def test_bad_training_inputs():
    with pytest.raises(ValueError, match="steps"):
        make_train_config(steps=0)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        make_train_config(min_lr_ratio=2.0)
    with pytest.raises(ValueError, match="context_length"):
        run_train_lm(make_config(**TINY), make_train_config(steps=1, seq_len=128, progress=False))
    with pytest.raises(ValueError, match="checkpoint_path"):
        run_train_lm(make_config(**TINY), make_train_config(steps=1, seq_len=16, progress=False), resume=True)


def test_unknown_preset_is_a_clear_error():
    from cs336_inference.shipped_models import train_preset
    with pytest.raises(ValueError, match="unknown training preset 'nope'.*target"):
        train_preset("nope")
    with pytest.raises(ValueError, match="unknown preset"):
        make_config().from_name("nope")
