import pytest
import torch
from adapters import (make_config, make_model, run_load_checkpoint, run_load_cs336_checkpoint, run_model,
                      run_save_checkpoint)

from cs336_inference.model import load_pretrained

CFG = dict(vocab_size=257, context_length=32, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=48)


def _same_outputs(a, b):
    x = torch.randint(0, 257, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(run_model(a, x), run_model(b, x), atol=0, rtol=0)


def test_save_load_round_trip(tmp_path):
    model = make_model(make_config(**CFG))
    run_save_checkpoint(tmp_path / "m.pt", model)
    loaded = run_load_checkpoint(tmp_path / "m.pt")
    assert loaded.config == model.config
    _same_outputs(model, loaded)


def test_cs336_checkpoint_with_orig_mod_prefix_and_optimizer(tmp_path):
    cfg = make_config(**CFG)
    model = make_model(cfg)
    state = {f"_orig_mod.{k}": v for k, v in model.state_dict().items()}
    torch.save({"model": state, "optimizer": {"state": {}}, "iteration": 10}, tmp_path / "a1.pt")
    _same_outputs(model, run_load_cs336_checkpoint(tmp_path / "a1.pt", cfg))
    _same_outputs(model, run_load_cs336_checkpoint(model.state_dict(), cfg))


def test_mismatched_checkpoint_names_the_keys():
    cfg = make_config(**CFG)
    state = make_model(cfg).state_dict()
    state.pop("layers.1.ffn.w2.weight")
    state["layers.0.attn.rotary.freqs"] = torch.zeros(3)
    with pytest.raises(ValueError) as err:
        run_load_cs336_checkpoint(state, cfg)
    assert "layers.1.ffn.w2.weight" in str(err.value) and "layers.0.attn.rotary.freqs" in str(err.value)


def test_shape_mismatch_names_key_and_shapes():
    state = make_model(make_config(**CFG)).state_dict()
    mha = make_config(**{**CFG, "num_kv_heads": 4})  # k/v projections are twice as tall
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.k_proj\.weight: checkpoint \(16, 32\) vs model \(32, 32\)"):
        run_load_cs336_checkpoint(state, mha)


def test_bad_files_and_names(tmp_path):
    with pytest.raises(FileNotFoundError):
        run_load_checkpoint(tmp_path / "missing.pt")
    torch.save({"weights": 1}, tmp_path / "odd.pt")
    with pytest.raises(ValueError, match="not a"):
        run_load_checkpoint(tmp_path / "odd.pt")
    with pytest.raises(ValueError, match="no model weights"):
        run_load_cs336_checkpoint(tmp_path / "odd.pt", make_config(**CFG))
    with pytest.raises(ValueError, match="unknown pretrained model"):
        load_pretrained("no-such-model")
