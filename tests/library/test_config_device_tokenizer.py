import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import cs336_inference
from adapters import (config_from_name, get_tokenizer, make_config, run_default_dtype, run_get_device,
                      run_seed_everything)


@pytest.mark.parametrize("field, value, exc", [
    ("d_model", 30, ValueError),        # not divisible by num_heads=4
    ("num_kv_heads", 3, ValueError),    # does not divide num_heads=4
    ("vocab_size", 0, ValueError),
    ("num_layers", -2, ValueError),
    ("d_ff", 2.5, TypeError),
    ("rope_theta", -1.0, ValueError),
    ("attention_type", "linear", ValueError),
    ("kv_share_group", 3, ValueError),  # does not divide num_layers=4
    ("sliding_window", 0, ValueError),
    ("kv_lora_rank", 0, ValueError),
])
def test_invalid_config_fields_are_named(field, value, exc):
    base = dict(vocab_size=257, context_length=32, d_model=32, num_layers=4, num_heads=4, d_ff=48)
    with pytest.raises(exc, match=field if field != "d_model" else "d_model"):
        make_config(**{**base, field: value})


def test_defaults_and_presets():
    cfg = make_config(d_model=64, num_heads=8)
    assert cfg.num_kv_heads == 8 and cfg.head_dim == 8
    bench = config_from_name("bench-90m")
    assert (bench.d_model, bench.d_ff, bench.num_layers, bench.num_heads, bench.num_kv_heads) == (768, 2048, 12, 12, 4)
    with pytest.raises(ValueError, match="available presets"):
        config_from_name("gpt-5")


def test_device_helpers():
    assert run_get_device("cpu") == torch.device("cpu")
    assert run_default_dtype("cpu") == torch.float32
    with pytest.raises(ValueError, match="prefer"):
        run_get_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            run_get_device("cuda")
    a = torch.rand(3, generator=run_seed_everything(5))
    b = torch.rand(3, generator=run_seed_everything(5))
    assert torch.equal(a, b)
    with pytest.raises(ValueError):
        run_seed_everything(-1)


def test_byte_tokenizer_round_trip_and_specials():
    tok = get_tokenizer()
    text = "héllo <|endoftext|> wörld ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids.count(256) == 1 and tok.eot_id == 256 and tok.vocab_size == 257
    assert all(0 <= i < 256 for i in tok.encode("plain ascii"))
    with pytest.raises(ValueError, match="outside"):
        tok.decode([300])
    with pytest.raises(TypeError):
        tok.encode(b"bytes")


def test_cli_help_lists_subcommands():
    src = str(Path(cs336_inference.__file__).resolve().parents[1])  # this checkout's package
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "cs336_inference", "--help"], capture_output=True, text=True,
                         check=True, env=env).stdout
    for command in ("lecture", "bench"):
        assert command in out
